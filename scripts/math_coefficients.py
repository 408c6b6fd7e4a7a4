"""Derives the polynomial coefficients in firmware/colibri_core/src/colibri_math.h (run it to check them).

    .venv/bin/python scripts/math_coefficients.py

Needs mpmath (a torch dependency). Everything is computed at 50 digits:
- tanh: Taylor coefficients of (tanh(x) - x) / x^3 in x^2, for |x| < 0.55;
- erf: Taylor coefficients of erf(x) / x - 1 in x^2, for |x| < 1;
- erfc: R(x) = exp(x^2) erfc(x) on [1, 2.5] and [2.5, 4], a least-squares
  fit in relative error on Chebyshev nodes, polynomial in u = x - midpoint.
Each list is printed with the worst truncation or fit error it leaves, which
is far below a float's half ulp (3e-8) and near a double's, so the error of
the float functions is their rounding, not their approximation.
"""
import mpmath as mp

mp.mp.dps = 50


def tanh_series(x_max: float, tol: float):
    # tanh(x) = x + x^3 * sum_n c_n x^(2n): from the Taylor coefficients a_k of tanh.
    a = mp.taylor(mp.tanh, 0, 80)
    coeffs = []
    for n in range(40):
        c = a[2 * n + 3]
        coeffs.append(c)
        if abs(c) * x_max ** (2 * n + 2) < tol:
            break
    return coeffs


def erf_series(x_max: float, tol: float):
    # erf(x) = x + x * q(x^2), q(z) = (2/sqrt(pi) - 1) + sum_{n>=1} 2/sqrt(pi) (-1)^n z^n / (n! (2n+1))
    k = 2 / mp.sqrt(mp.pi)
    coeffs = [k - 1]
    n = 1
    while True:
        c = k * (-1) ** n / (mp.factorial(n) * (2 * n + 1))
        coeffs.append(c)
        if abs(c) * x_max ** (2 * n) < tol:
            return coeffs
        n += 1


def erfc_fit(a: float, b: float, degree: int, nodes: int = 300):
    R = lambda x: mp.exp(x * x) * mp.erfc(x)
    mid, half = mp.mpf(a + b) / 2, mp.mpf(b - a) / 2
    xs = [mid + half * mp.cos(mp.pi * (i + mp.mpf(1) / 2) / nodes) for i in range(nodes)]
    A = mp.matrix(nodes, degree + 1)
    y = mp.matrix(nodes, 1)
    for i, x in enumerate(xs):
        r = R(x)
        for j in range(degree + 1):
            A[i, j] = (x - mid) ** j / r
        y[i] = 1
    c = mp.qr_solve(A, y)[0]
    worst = max(abs(mp.polyval(list(reversed(c)), x - mid) / R(x) - 1)
                for x in (mid + half * mp.mpf(k) / 400 for k in range(-400, 401)))
    return float(mid), [c[j] for j in range(degree + 1)], worst


def show(name, coeffs, note):
    print(f"/* {note} */")
    print(f"static const real_t {name}[] = {{")
    for c in coeffs:
        print(f"    (real_t){mp.nstr(c, 20, min_fixed=0, max_fixed=0)},")
    print("};")


if __name__ == "__main__":
    t = tanh_series(0.55, 1e-14)
    show("tanh_c", t, f"{len(t)} terms")
    e = erf_series(1.0, 1e-15)
    show("erf_q", e, f"{len(e)} terms")
    for a, b, deg in ((1.0, 2.5, 12), (2.5, 4.0, 10)):
        mid, c, worst = erfc_fit(a, b, deg)
        show(f"erfc_r_{str(a).replace('.', '_')}", c, f"[{a}, {b}] about {mid}: max relative error {float(worst):.2g}")

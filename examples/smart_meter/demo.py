"""The smart meter story end to end (what `make demo` runs).

1. Train a 3-expert MoE day-ahead load forecaster on real demand data (or reuse
   the cached one), next to a seasonal-naive baseline and a dense MLP of the
   same flash budget; print a table of MAE on 21 held-out days.
2. Quantise it to int8 (q8 with sparse f16 compensation) and check the loss.
3. Build the runner firmware, boot it in QEMU (Cortex-M7, mps2-an500), flash
   the model into an A/B slot over the serial line, forecast on target.
4. Run the same forecast from MicroPython (the native colibri.mpy).
5. Print the forecast error, flash/RAM footprint and instructions per
   inference; draw forecast against actual to a PNG.

    .venv/bin/python examples/smart_meter/demo.py [--retrain] [--out build/smart_meter]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import forecaster as F  # noqa: E402

import colibri  # noqa: E402
from colibri.quant import quantize as Q  # noqa: E402
from colibri.frontends.exporter import build_graph  # noqa: E402
from colibri.quant.report import quantisation_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CACHE_VERSION = 1  # bump when forecaster.py changes the model or the data split


def trained_models(out: Path, retrain: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The MoE and the dense MLP, trained once and cached under `out`."""
    stamp = out / "models.json"
    moe_path, dense_path = out / "moe.pt", out / "dense.pt"
    if not retrain and stamp.exists() and json.loads(stamp.read_text()).get("version") == CACHE_VERSION:
        print(f"reusing the trained models in {out}")
        return torch.load(moe_path, weights_only=False), torch.load(dense_path, weights_only=False)
    data = F.dataset()
    t0 = time.perf_counter()
    moe = F.train(F.build_moe(), data, progress=True)
    dense = F.train(F.build_dense(), data, progress=True)
    print(f"trained both models in {time.perf_counter() - t0:.0f} s")
    torch.save(moe, moe_path)
    torch.save(dense, dense_path)
    stamp.write_text(json.dumps({"version": CACHE_VERSION}))
    return moe, dense


def table(rows: list[tuple[str, str, float]]) -> None:
    print(f"\n{'model':<34} {'weights':>10} {'MAE (MW)':>10}")
    for name, weights, mae in rows:
        print(f"{name:<34} {weights:>10} {mae:>10.0f}")
    print()


def on_target(image: bytes, data: F.Dataset) -> dict:
    """Boots the runner in QEMU, flashes the model into a slot over the serial line
    (as `colibri flash` does), and forecasts the held-out days on the Cortex-M7."""
    from colibri.target.device import Device
    from colibri.target.footprint import elf_footprint
    from colibri.target.firmware import build_runner
    from colibri.target.qemu import Qemu

    elf = build_runner()
    with Qemu(elf) as q, Device(q.url) as dev:
        hello = dev.hello()
        slots = dev.update(image, progress=True)
        print(f"flashed the model into slot {slots.running} of {hello.board}: {len(image):,} B, CRC verified in flash")
        info = dev.model_info()
        outputs, works = [], []
        for start in range(0, len(data.x_test), info.max_batch):
            y, work = dev.forward(data.x_test[start : start + info.max_batch])
            outputs.append(y)
            works.append(work.count / len(y))
        y1, work1 = dev.forward(data.x_test[:1])
        stats = dev.stats()
    fp = elf_footprint(elf)
    return {
        "board": hello.board, "prediction": np.concatenate(outputs), "per_token": float(np.mean(works)),
        "batch1": work1, "stack": stats.stack_used, "arena": info.arena_size, "flash": fp.flash,
    }


MICROPYTHON_SCRIPT = """
import sys, colibri
from array import array
model = colibri.Model(open(sys.argv[1], "rb").read())
x = array("f", open(sys.argv[2], "rb").read())
n = len(x) // model.input_size
out = open(sys.argv[3], "wb")
for i in range(0, n, model.max_batch):
    b = min(model.max_batch, n - i)
    y = array("f", bytes(4 * b * model.output_size))
    colibri.forward(model, x[i * model.input_size:(i + b) * model.input_size], y)
    out.write(y)
out.close()
print("forecast", n, "days on MicroPython", colibri.version())
"""


def on_micropython(image_path: Path, data: F.Dataset, out: Path) -> np.ndarray:
    """The same forecast from MicroPython: the native colibri.mpy in the real interpreter (unix port)."""
    from colibri.target import natmod

    mpy_dir = out / "mpy"
    natmod.build("x64", mpy_dir / "colibri.mpy")
    (out / "forecast_mp.py").write_text(MICROPYTHON_SCRIPT)
    (out / "x_test.f32").write_bytes(data.x_test.astype("<f4").tobytes())
    exe = Path(sys.executable).parent / "micropython"
    r = subprocess.run([str(exe), "forecast_mp.py", str(image_path), "x_test.f32", "y_mp.f32"], cwd=out,
                       env={"MICROPYPATH": str(mpy_dir), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                       timeout=120)
    if r.returncode != 0:
        raise SystemExit(f"MicroPython run failed: {r.stdout}{r.stderr}")
    print(r.stdout.strip())
    return np.fromfile(out / "y_mp.f32", dtype="<f4").reshape(len(data.x_test), F.HORIZON)


def plot(data: F.Dataset, forecasts: dict[str, np.ndarray], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    days = 7  # the last week of the held-out period
    hours = np.arange(days * F.HORIZON) / 2
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.plot(hours, data.y_test[-days:].ravel(), color="black", lw=1.5, label="actual")
    for name, pred in forecasts.items():
        ax.plot(hours, pred[-days:].ravel(), lw=1, label=name)
    ax.set_xlabel("hours (last 7 held-out days, day-ahead forecasts issued at midnight)")
    ax.set_ylabel("demand (MW)")
    ax.set_title("England & Wales demand, summer 2000: day-ahead forecasts")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "smart_meter")
    ap.add_argument("--retrain", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)

    data = F.dataset()
    moe, dense = trained_models(args.out, args.retrain)
    with torch.no_grad():
        moe_f32 = moe(torch.from_numpy(data.x_test)).numpy()
        dense_f32 = dense(torch.from_numpy(data.x_test)).numpy()

    graph, _ = build_graph(moe, max_batch=7)
    q8 = Q.quantize(graph, "q8")
    image = colibri.image.write(q8)
    image_path = args.out / "meter_q8.clb"
    image_path.write_bytes(image)
    f32_bytes = len(colibri.image.write(graph))
    host_q8 = colibri.Model(image).forward(data.x_test)
    rep = quantisation_report(graph, q8, data.x_train)
    print(f"q8 model {image_path.name}: {len(image):,} B ({len(image) / f32_bytes:.2f} of f32), "
          f"routing agreement {100 * next(iter(rep.routing_agreement.values())):.1f}% over {rep.tokens} training windows, "
          f"end-to-end rel. error {rep.end_to_end_rel_l2:.2e}")

    target = on_target(image, data)
    micropython = on_micropython(image_path, data, args.out)
    table([
        ("seasonal naive (same day last week)", "-", F.naive_mae(data)),
        ("dense MLP, f32 (PyTorch)", f"{F.n_weights(dense):,}", F.mae_mw(dense_f32, data)),
        ("MoE 3 experts, f32 (PyTorch)", f"{F.n_weights(moe):,}", F.mae_mw(moe_f32, data)),
        ("MoE q8, C engine on host", f"{F.n_weights(moe):,}", F.mae_mw(host_q8, data)),
        (f"MoE q8, on {target['board']}", f"{F.n_weights(moe):,}", F.mae_mw(target["prediction"], data)),
        ("MoE q8, MicroPython (colibri.mpy)", f"{F.n_weights(moe):,}", F.mae_mw(micropython, data)),
    ])
    agree = float(np.abs(target["prediction"] - host_q8).max())
    agree_mp = float(np.abs(micropython - host_q8).max())
    print(f"target vs host engine: max |diff| {agree:.2g}; MicroPython vs host engine: {agree_mp:.2g} (scaled units)")
    print(f"work per inference on the Cortex-M7: {target['batch1']} at batch 1, "
          f"{target['per_token']:,.0f} per token at batch 7")
    print(f"footprint: runner firmware {target['flash']:,} B flash; model {len(image):,} B; "
          f"arena {target['arena']:,} B RAM; stack high-water {target['stack']:,} B")

    png = args.out / "forecast.png"
    plot(data, {"MoE q8 on target": target["prediction"] * data.std + data.mean,
                "seasonal naive": data.naive_test}, png)
    print(f"wrote {png}")
    beats = F.mae_mw(target["prediction"], data) < F.naive_mae(data)
    print("MoE beats the seasonal-naive baseline on held-out days" if beats else "MoE does NOT beat seasonal naive")
    tolerance = 1e-5 * (1 + np.abs(host_q8).max())
    raise SystemExit(0 if beats and agree <= tolerance and agree_mp <= tolerance else 1)


if __name__ == "__main__":
    main()

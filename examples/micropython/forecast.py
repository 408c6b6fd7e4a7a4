"""Load forecast on a MicroPython board with Colibri.

    micropython forecast.py [model.clb]          # unix port
    mpremote run forecast.py                     # a board with colibri.mpy and model.clb on it

Loads a Colibri model image that maps the last 48 half-hourly meter readings
(one day) to the next 24 (twelve hours), as examples/quickstart.py builds it,
feeds it a household's load curve and prints the forecast in kW.

The curve is synthetic but shaped like a real one: a base load, a morning and
an evening peak, and a little deterministic jitter. The quickstart model is
untrained, so its numbers are not a real forecast; a trained model exported
with the same shape is used the same way.

The helpers import under CPython too (`colibri` is imported in main() only),
so tests/micropython/test_micropython_module.py builds the same input with `load_curve` and
`normalise` and checks the printed forecast against the CPython engine.
"""
import math
import sys
from array import array

DEFAULT_MODEL = "model.clb"


def load_curve(n):
    """kW at each half hour of one day: base load, breakfast and evening peaks, jitter."""
    out = []
    for i in range(n):
        hour = (i % 48) / 2
        kw = 0.35 + 0.15 * math.sin(2 * math.pi * (hour - 9) / 24)
        kw += 0.9 * math.exp(-(((hour - 7.5) / 1.2) ** 2))
        kw += 1.6 * math.exp(-(((hour - 19.0) / 1.8) ** 2))
        kw += 0.05 * math.sin(12.9898 * i)
        out.append(kw)
    return out


def normalise(series):
    """Zero mean, unit spread, as the model sees its input: (array('f'), mean, scale)."""
    mean = sum(series) / len(series)
    scale = math.sqrt(sum((v - mean) ** 2 for v in series) / len(series)) or 1.0
    return array("f", [(v - mean) / scale for v in series]), mean, scale


def main():
    import colibri

    path = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL
    with open(path, "rb") as f:
        model = colibri.Model(f.read())  # validates the image, allocates the arena once

    inp, mean, scale = normalise(load_curve(model.input_size))
    out = array("f", [0.0] * model.output_size)  # allocated once; forward() allocates nothing
    colibri.forward(model, inp, out)

    print("colibri", colibri.version(), "|", path, "|", model.num_experts, "experts, arena",
          model.arena_size, "bytes")
    print("forecast, next %d half hours:" % model.output_size)
    for i in range(model.output_size):
        minutes = 30 * (i + 1)
        print("+%02d:%02d  %.6f kW" % (minutes // 60, minutes % 60, out[i] * scale + mean))


if __name__ == "__main__":
    main()

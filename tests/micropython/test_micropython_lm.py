"""colibri.LM, the token-model API of the MicroPython module, in the real MicroPython interpreter.

The interpreter and the module are tests/micropython/test_micropython_module.py's (the x64 .mpy from `colibri natmod
build`, or COLIBRI_MICROPYTHON with `colibri` compiled in: COLIBRI_MICROPYTHON_BUILTIN=1), and so is
the claim: the same C engine on the same image with the same kernels (reference kernels for the
.mpy), so logits are the host colibri.LM's bits and generated ids are the host's ids, greedy and
sampled (the engine's own sampler and SplitMix64 on both sides).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import colibri
from colibri import image
from colibri.model.format import STATUS_TEXT, Status
from helpers.lmmodels import CONFIGS, config_graph
from helpers.micropython import BUILTIN, after, assert_same_bits, make_model, mp_script, repl, run_mp

pytestmark = pytest.mark.micropython

# A spread of the engine's LM paths: GQA, MQA with biases, q/k norms, an f16 KV cache, f16 and q8 weights.
LM_CONFIGS = ("f32-gqa", "f32-mqa-bias", "f32-qknorm-all", "f16kv", "f16", "q8-tied-f16kv")
# Each sequence goes through a different kind of id container, every one of them used.
ID_KINDS = ("list", "tuple", "bytes", "array_h", "array_i", "bytearray")
SAMPLED = dict(temperature=2.0, top_k=20, top_p=0.95, seed=1234)


def host_lm(path: Path) -> colibri.LM:
    """The host engine with the kernels the interpreter's module runs."""
    return colibri.LM(path, reference_kernels=not BUILTIN)


@pytest.fixture(scope="module")
def lm_images(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("lm_images")
    paths = {}
    for seed, name in enumerate(LM_CONFIGS):
        paths[name] = tmp / f"{name}.clb"
        paths[name].write_bytes(image.write(config_graph(seed + 3, CONFIGS[name])))
    return paths


# --------------------------------------------------------------------------- logits and generated ids

MATRIX_SCRIPT = """
import sys
import colibri
from array import array


def read(path):
    with open(path, "rb") as f:
        return f.read()


def ids_as(ids, kind):
    if kind == "list":
        return list(ids)
    if kind == "tuple":
        return tuple(ids)
    if kind == "bytes":
        return bytes(ids)
    if kind == "bytearray":
        return bytearray(ids)
    return array("h" if kind == "array_h" else "i", ids)


for line in open(sys.argv[1]):
    name, kind, model_path, ids_path = line.split()
    lm = colibri.LM(read(model_path))
    V, B = lm.vocab_size, lm.max_batch
    ids = list(array("i", read(ids_path)))
    # a prefill longer than max_batch (fed in chunks), then one token at a time to the last position,
    # alternately into a new array and into the caller's
    first = B + 3
    logits = lm.forward_tokens(ids_as(ids[:first], kind))
    out = array("f", bytes(4 * V))
    with open(ids_path + ".logits", "wb") as f:
        f.write(logits)
        for i in range(first, len(ids)):
            if i % 2:
                f.write(lm.forward_tokens(ids_as(ids[i:i + 1], kind)))
            else:
                assert lm.forward_tokens(ids_as(ids[i:i + 1], kind), out) is out
                f.write(out)
    print("POSITION", name, lm.position)
    prompt = ids_as(ids[:5], kind)
    print("GREEDY", name, lm.generate(prompt, 10))
    print("SAMPLED", name, lm.generate(prompt, 10, temperature=2.0, top_k=20, top_p=0.95, seed=1234))
    print("SAMPLED_POSITIONAL", name, lm.generate(prompt, 10, 2.0, 20, 0.95, 1234))
    into = array("i", [-1] * 12)
    n = lm.generate(prompt, 10, temperature=2.0, top_k=20, top_p=0.95, seed=1234, out=into)
    print("SAMPLED_OUT", name, n, list(into))
    print("AFTER", name, lm.position)
    print("INFO", name, V, lm.max_seq_len, B, lm.arena_size, lm.kv_cache_bytes)
"""


def ids_of(line_prefix: str, stdout: str) -> dict[str, str]:
    return {ln.split()[1]: ln.split(None, 2)[2] for ln in stdout.splitlines() if ln.startswith(line_prefix + " ")}


@pytest.fixture(scope="module")
def lm_matrix(mpy_dir: Path, lm_images: dict[str, Path], tmp_path_factory) -> tuple[Path, dict[str, np.ndarray], str]:
    tmp = tmp_path_factory.mktemp("lm_matrix")
    rng = np.random.default_rng(11)
    lines, sequences = [], {}
    for i, (name, path) in enumerate(lm_images.items()):
        host = colibri.LM(path)
        ids = rng.integers(0, host.vocab_size, host.max_seq_len).astype(np.int32)
        sequences[name] = ids
        (tmp / f"{name}.ids").write_bytes(ids.tobytes())
        lines.append(f"{name} {ID_KINDS[i % len(ID_KINDS)]} {path} {name}.ids")
    (tmp / "manifest.txt").write_text("\n".join(lines) + "\n")
    r = run_mp(mp_script(tmp, "lm_matrix.py", MATRIX_SCRIPT), "manifest.txt", mpy_dir=mpy_dir, cwd=tmp)
    assert r.returncode == 0, r.stdout + r.stderr
    return tmp, sequences, r.stdout


def test_every_id_container_ran(lm_matrix) -> None:
    _, _, stdout = lm_matrix
    assert len(ids_of("INFO", stdout)) == len(LM_CONFIGS) >= len(ID_KINDS), stdout


@pytest.mark.parametrize("name", LM_CONFIGS)
def test_logits_are_the_host_engines(lm_matrix, lm_images: dict[str, Path], name: str) -> None:
    """Every position's logits, prefill chunks and single decode steps, are the host LM's bits."""
    folder, sequences, stdout = lm_matrix
    ids = sequences[name]
    host = host_lm(lm_images[name])
    first = host.max_batch + 3
    want = np.concatenate([host.forward_tokens(ids[:first])] +
                          [host.forward_tokens(ids[i:i + 1]) for i in range(first, len(ids))])
    got = np.fromfile(folder / f"{name}.ids.logits", dtype=np.float32).reshape(want.shape)
    assert_same_bits(got, want, name)
    assert ids_of("POSITION", stdout)[name] == str(host.max_seq_len)


@pytest.mark.parametrize("name", LM_CONFIGS)
def test_generated_ids_are_the_host_engines(lm_matrix, lm_images: dict[str, Path], name: str) -> None:
    """Greedy and seeded sampling draw the host's ids, whether returned as a list or written into a buffer."""
    _, sequences, stdout = lm_matrix
    host = host_lm(lm_images[name])
    prompt = sequences[name][:5]
    greedy = host.generate(prompt, 10)
    sampled = host.generate(prompt, 10, **SAMPLED)
    assert sampled != greedy  # the sampler settings matter for this model: the comparison can fail
    assert ids_of("GREEDY", stdout)[name] == str(greedy)
    assert ids_of("SAMPLED", stdout)[name] == str(sampled)
    assert ids_of("SAMPLED_POSITIONAL", stdout)[name] == str(sampled)
    assert ids_of("SAMPLED_OUT", stdout)[name] == f"10 {sampled + [-1, -1]}"
    # generate resets, feeds the 5 prompt ids and feeds back every new id but the last
    assert ids_of("AFTER", stdout)[name] == str(5 + 10 - 1)
    info = [host.vocab_size, host.max_seq_len, host.max_batch, host.arena_size, host.kv_cache_bytes]
    assert ids_of("INFO", stdout)[name] == " ".join(map(str, info))


# --------------------------------------------------------------------------- the trained tiny LM at the REPL

TINY_SESSION = """\
import colibri
lm = colibri.LM(open("tiny_lm.clb", "rb").read())
lm.vocab_size, lm.max_seq_len
out = bytearray(48)
lm.generate(b"And God said,", 48, out=out)
print(out.decode())
print(bytes(lm.generate(b"In the beginning", 40, temperature=0.7, top_k=20, seed=42)).decode())
"""


def test_tiny_lm_writes_the_hosts_text_at_the_repl(mpy_dir: Path, tmp_path: Path) -> None:
    """examples/tiny_lm's committed model, exported as tests/lm/test_lm_tiny_engine.py does, generates at the
    MicroPython REPL the bytes the host engine generates: greedy into a bytearray, and sampled."""
    import sys

    from helpers.build import ROOT
    sys.path.insert(0, str(ROOT / "examples" / "tiny_lm"))
    try:
        import evaluate
    finally:
        sys.path.remove(str(ROOT / "examples" / "tiny_lm"))
    path = evaluate.image_path("f32")
    (tmp_path / "tiny_lm.clb").write_bytes(path.read_bytes())
    out = repl(mpy_dir, tmp_path, TINY_SESSION)
    host = host_lm(path)
    greedy = bytes(host.generate(list(b"And God said,"), 48)).decode("ascii")
    sampled = bytes(host.generate(list(b"In the beginning"), 40, temperature=0.7, top_k=20, seed=42)).decode("ascii")
    assert re.search(r"[A-Za-z]+ [A-Za-z]+", greedy), greedy  # words, from a trained model
    assert after(out, "lm.vocab_size, lm.max_seq_len") == f"(256, {host.max_seq_len})\n"
    assert after(out, 'lm.generate(b"And God said,", 48, out=out)') == "48\n"
    assert after(out, "print(out.decode())") == greedy + "\n"
    assert after(out, 'print(bytes(lm.generate(b"In the beginning", 40, temperature=0.7, top_k=20, seed=42))'
                      '.decode())') == sampled + "\n"
    assert "Traceback" not in out, out


# --------------------------------------------------------------------------- no allocation per token

HEAP_SCRIPT = """
import gc
import sys
import micropython
import colibri
from array import array


def main():
    with open(sys.argv[1], "rb") as f:
        lm = colibri.LM(f.read())
    V = lm.vocab_size
    prompt = array("h", [1, 2, 3, 4, 5])
    one = array("h", [7])
    row = array("f", bytes(4 * V))
    rows = array("f", bytes(4 * V * len(prompt)))
    ids = array("i", [0] * 12)
    lm.generate(prompt, 12, temperature=0.8, top_k=5, seed=3, out=ids)
    want = list(ids)
    gc.collect()
    micropython.heap_lock()
    try:
        for i in range(20):
            lm.reset()
            lm.forward_tokens(prompt, rows)
            lm.forward_tokens(one, row)
            lm.forward_tokens(one, out=row)
            n = lm.generate(prompt, 12, temperature=0.8, top_k=5, seed=3, out=ids)
            lm.generate(prompt, 12, out=ids)
            lm.generate(prompt, 12, temperature=0.8, top_k=5, seed=3, out=ids)
            lm.position + lm.vocab_size + lm.max_seq_len + lm.max_batch + lm.arena_size + lm.kv_cache_bytes
        result = "ok"
    except MemoryError:
        result = "MemoryError"
    micropython.heap_unlock()
    print("LOCKED", result, n, list(ids) == want)
    # and a call that must allocate does raise under the lock: the lock is real
    micropython.heap_lock()
    try:
        lm.generate(prompt, 3)
        print("UNLOCKED_LIST no error")
    except MemoryError:
        print("UNLOCKED_LIST MemoryError")
    micropython.heap_unlock()


main()
"""


def test_decoding_into_caller_buffers_allocates_nothing(mpy_dir: Path, lm_images: dict[str, Path],
                                                        tmp_path: Path) -> None:
    """forward_tokens into an array('f') and generate into an integer buffer run under
    micropython.heap_lock(), where any allocation raises MemoryError, and draw the same ids."""
    r = run_mp(mp_script(tmp_path, "heap.py", HEAP_SCRIPT), lm_images["f32-gqa"], mpy_dir=mpy_dir, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "LOCKED ok 12 True" in r.stdout, r.stdout
    assert "UNLOCKED_LIST MemoryError" in r.stdout, r.stdout


# --------------------------------------------------------------------------- bad calls

BAD_CALLS_SCRIPT = """
import sys
import colibri
from array import array


def read(path):
    with open(path, "rb") as f:
        return f.read()


data = read(sys.argv[1])
feature = read(sys.argv[2])
lm = colibri.LM(data)
V, S, B = lm.vocab_size, lm.max_seq_len, lm.max_batch


def f32(n):
    return array("f", bytes(4 * n))


def fill_then(call):
    lm.reset()
    lm.forward_tokens([1] * (S - 1))
    call()


def resized_under_the_lm():
    buf = bytearray(data)
    moved = colibri.LM(buf)
    buf.extend(bytes(100000))
    moved.forward_tokens([1])

CASES = (
    ("lm_feature_image", lambda: colibri.LM(feature)),
    ("model_token_image", lambda: colibri.Model(data)),
    ("lm_int", lambda: colibri.LM(5)),
    ("lm_path_string", lambda: colibri.LM("lm.clb")),
    ("lm_garbage", lambda: colibri.LM(b"garbage!" * 16)),
    ("lm_writable_view", lambda: colibri.LM(memoryview(bytearray(data)))),
    ("forward_token_too_big", lambda: lm.forward_tokens([1, V])),
    ("forward_token_negative", lambda: lm.forward_tokens([-1])),
    ("forward_token_huge", lambda: lm.forward_tokens([2 ** 70])),
    ("forward_token_float", lambda: lm.forward_tokens([1.5])),
    ("forward_ids_string", lambda: lm.forward_tokens("abc")),
    ("forward_ids_float_array", lambda: lm.forward_tokens(array("f", [1.0]))),
    ("forward_out_short", lambda: lm.forward_tokens([1, 2], f32(V))),
    ("forward_out_long", lambda: lm.forward_tokens([1], f32(V + 1))),
    ("forward_out_double", lambda: lm.forward_tokens([1], array("d", [0.0] * V))),
    ("forward_out_twice", lambda: lm.forward_tokens([1], f32(V), out=f32(V))),
    ("forward_unknown_keyword", lambda: lm.forward_tokens([1], output=f32(V))),
    ("forward_cache_full", lambda: fill_then(lambda: lm.forward_tokens([1, 2]))),
    ("generate_cache_full", lambda: lm.generate([1] * S, 2)),
    ("generate_empty_prompt", lambda: lm.generate([], 3)),
    ("generate_bad_prompt_token", lambda: lm.generate([0, V], 3)),
    ("generate_negative_count", lambda: lm.generate([1], -1)),
    ("generate_negative_temperature", lambda: lm.generate([1], 3, temperature=-1.0)),
    ("generate_nan_temperature", lambda: lm.generate([1], 3, temperature=float("nan"))),
    ("generate_top_p_zero", lambda: lm.generate([1], 3, top_p=0.0)),
    ("generate_negative_top_k", lambda: lm.generate([1], 3, top_k=-2)),
    ("generate_float_seed", lambda: lm.generate([1], 3, seed=1.5)),
    ("generate_out_short", lambda: lm.generate([1], 5, out=array("i", [0] * 4))),
    ("generate_out_float", lambda: lm.generate([1], 2, out=array("f", [0.0] * 2))),
    ("generate_out_bytes", lambda: lm.generate([1], 2, out=bytes(2))),
    ("generate_unknown_keyword", lambda: lm.generate([1], 2, temp=0.5)),
    ("generate_too_many_arguments", lambda: lm.generate([1], 2, 0.5, 1, 0.9, 3, None, 7)),
    ("lm_attribute_store", lambda: setattr(lm, "position", 0)),
    ("lm_image_resized", resized_under_the_lm),
)
for name, call in CASES:
    try:
        call()
        print("CASE", name, "NoException", "")
    except Exception as e:
        print("CASE", name, type(e).__name__, repr(str(e)))
    print("ALIVE", name)

# nothing a refused call did reached the sequence: the cache holds what the last good call left
lm.reset()
lm.forward_tokens([3, 4])
try:
    lm.forward_tokens([5, V])
except ValueError:
    pass
print("POSITION_AFTER_REFUSAL", lm.position)
print("END", lm.generate([1, 2, 3], 4))
"""

BAD_CALLS: dict[str, tuple[str, Status | None]] = {
    "lm_feature_image": ("ValueError", Status.MODEL_KIND),
    "model_token_image": ("ValueError", Status.MODEL_KIND),
    "lm_int": ("TypeError", None),
    "lm_path_string": ("TypeError", None),
    "lm_garbage": ("ValueError", Status.BAD_MAGIC),
    "lm_writable_view": ("TypeError", None),
    "forward_token_too_big": ("ValueError", Status.BAD_TOKEN),
    "forward_token_negative": ("ValueError", Status.BAD_TOKEN),
    "forward_token_huge": ("ValueError", Status.BAD_TOKEN),
    "forward_token_float": ("TypeError", None),
    "forward_ids_string": ("TypeError", None),
    "forward_ids_float_array": ("TypeError", None),
    "forward_out_short": ("ValueError", Status.BUFFER_SIZE),
    "forward_out_long": ("ValueError", Status.BUFFER_SIZE),
    "forward_out_double": ("TypeError", None),
    "forward_out_twice": ("TypeError", None),
    "forward_unknown_keyword": ("TypeError", None),
    "forward_cache_full": ("ValueError", Status.CACHE_FULL),
    "generate_cache_full": ("ValueError", Status.CACHE_FULL),
    "generate_empty_prompt": ("ValueError", Status.BAD_BATCH),
    "generate_bad_prompt_token": ("ValueError", Status.BAD_TOKEN),
    "generate_negative_count": ("ValueError", None),
    "generate_negative_temperature": ("ValueError", Status.BAD_SAMPLER),
    "generate_nan_temperature": ("ValueError", Status.BAD_SAMPLER),
    "generate_top_p_zero": ("ValueError", Status.BAD_SAMPLER),
    "generate_negative_top_k": ("ValueError", Status.BAD_SAMPLER),
    "generate_float_seed": ("TypeError", None),
    "generate_out_short": ("ValueError", Status.BUFFER_SIZE),
    "generate_out_float": ("TypeError", None),
    "generate_out_bytes": ("TypeError", None),
    "generate_unknown_keyword": ("TypeError", None),
    "generate_too_many_arguments": ("TypeError", None),
    "lm_attribute_store": ("AttributeError", None),
    "lm_image_resized": ("ValueError", None),
}


@pytest.fixture(scope="module")
def lm_bad_calls(mpy_dir: Path, lm_images: dict[str, Path], tmp_path_factory) -> dict[str, tuple[str, str]]:

    tmp = tmp_path_factory.mktemp("lm_bad")
    colibri.export(make_model("top1"), tmp / "feature.clb", max_batch=2)
    r = run_mp(mp_script(tmp, "bad.py", BAD_CALLS_SCRIPT), lm_images["f32-gqa"], "feature.clb", mpy_dir=mpy_dir,
               cwd=tmp)
    assert r.returncode == 0 and "\nEND " in r.stdout, r.stdout + r.stderr
    host = host_lm(lm_images["f32-gqa"])
    assert "POSITION_AFTER_REFUSAL 2" in r.stdout, r.stdout
    assert r.stdout.rstrip().endswith(f"END {host.generate([1, 2, 3], 4)}"), r.stdout
    lines = r.stdout.splitlines()
    results = {}
    for line in lines:
        if line.startswith("CASE "):
            _, name, exc, message = line.split(" ", 3)
            results[name] = (exc, message)
            assert lines[lines.index(f"ALIVE {name}") - 1] == line, name
    return results


@pytest.mark.parametrize("case", BAD_CALLS)
def test_lm_bad_call_raises(lm_bad_calls: dict[str, tuple[str, str]], case: str) -> None:
    """Wrong types raise TypeError; bad ids, sizes, settings, a full cache and the wrong kind of
    model raise ValueError carrying the engine's own words for its status."""
    exc_type, status = BAD_CALLS[case]
    assert case in lm_bad_calls, "the case did not run"
    exc, message = lm_bad_calls[case]
    assert exc == exc_type, f"{case}: {exc} {message}"
    assert message not in ("''", '""'), f"{case}: {exc} without a message"
    if status is not None:
        assert STATUS_TEXT[status] in message, f"{case}: {message}"

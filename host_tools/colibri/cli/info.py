"""`colibri info`, `colibri verify` and `colibri gen-header`: what an image holds, whether it is intact,
and the C header generated from colibri.model.format."""
from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import click
import numpy as np

from ..model import format as F
from ..model.errors import ColibriError, error_for
from .app import main


def _storage(weights: list) -> str:
    """Weight storage of a layer: f32, f16, q8 (+E), q4/g<group> (+E), or a mix."""
    from ..model.ir import F16Weight, Q4Weight, Q8Weight

    kinds = set()
    for w in weights:
        if isinstance(w, Q4Weight):
            kinds.add(f"q4/g{w.group}" + ("+E" if w.nnz else ""))
        elif isinstance(w, Q8Weight):
            kinds.add("q8+E" if w.nnz else "q8")
        elif isinstance(w, F16Weight):
            kinds.add("f16")
        else:
            kinds.add("f32")
    return "/".join(sorted(kinds))


def describe(data: bytes | memoryview | mmap.mmap) -> dict:
    """Everything `colibri info` shows, as plain data. Checks the image's structure only (as
    COLIBRI_CHECK_STRUCTURE: header, metadata CRC, tables, offsets, int8 companions), not the
    payload CRCs of a version-3 image: it reads no weight (`colibri verify` reads them all)."""
    from ..runtime import engine
    from .. import image
    from ..model.format import DType
    from ..model.ir import Activation, Attention, Embedding, LayerNorm, Linear, MoE, RMSNorm

    def numel(*tensors) -> int:
        return sum(int(np.prod(t.shape)) for t in tensors if t is not None)

    def affine(weight, bias) -> int:
        """A weight and its bias, the bias counted where it is stored: its own tensor, or (q8, q4) the
        weight's companion, so a layer counts the same parameters whatever its dtype."""
        return numel(weight, bias) + numel(getattr(weight, "bias", None))

    # int4 values stay packed: unpacked they would take a byte per parameter (7 GB for a 7 B q4 image),
    # and nothing here reads them
    graph = image.read(data, check="structure", unpack_int4=False)
    table = graph.layers[0].table if graph.is_token_model else None
    layers = []
    params = 0
    kv_cache = 0
    for layer in graph.layers:
        row: dict = {"op": type(layer).__name__, "dtype": ""}
        if isinstance(layer, Embedding):
            row.update(shape=f"{layer.vocab_size} tokens->{layer.d_model}", params=numel(layer.table),
                       dtype=_storage([layer.table]))
        elif isinstance(layer, Attention):
            kv_elem = 2 if layer.kv_dtype == DType.F16 else 4
            cache = 2 * layer.max_seq_len * layer.kv_width * kv_elem
            kv_cache += cache
            norm = "" if layer.q_norm is None else (
                " q/k norm per head" if layer.q_norm.shape[0] == layer.head_dim else " q/k norm")
            row.update(shape=f"{layer.d_model}->{layer.d_model}",
                       params=affine(layer.q_w, layer.q_b) + affine(layer.k_w, layer.k_b) + affine(layer.v_w, layer.v_b)
                       + affine(layer.o_w, layer.o_b) + numel(layer.q_norm, layer.k_norm),
                       dtype=_storage([layer.q_w, layer.k_w, layer.v_w, layer.o_w])
                       + (" int8-blocks" if layer.int8_blocks else ""),
                       heads=layer.n_heads, kv_heads=layer.n_kv_heads, head_dim=layer.head_dim,
                       rope_theta=layer.rope_theta, max_seq_len=layer.max_seq_len,
                       kv_dtype=layer.kv_dtype.name.lower(), kv_cache_bytes=cache,
                       attention=f"{layer.n_heads} heads / {layer.n_kv_heads} kv, head_dim {layer.head_dim}, "
                                 f"rope theta {layer.rope_theta:g}{norm}, KV cache {layer.max_seq_len} x "
                                 f"{layer.kv_dtype.name.lower()} ({cache:,} B)")
        elif isinstance(layer, Linear):
            tied = table is not None and layer.weight is table
            row.update(shape=f"{layer.in_features}->{layer.out_features}",
                       params=numel(layer.bias) if tied else affine(layer.weight, layer.bias),
                       dtype=_storage([layer.weight]) + (" int8-act" if layer.int8_act else "")
                       + (" int8-blocks" if layer.int8_blocks else ""), tied=tied)
        elif isinstance(layer, Activation):
            row.update(shape=layer.act.name.lower(), params=0)
        elif isinstance(layer, (LayerNorm, RMSNorm)):
            row.update(shape=f"{layer.size}, eps={layer.eps:g}",
                       params=numel(layer.weight, getattr(layer, "bias", None)))
        elif isinstance(layer, MoE):
            experts = layer.experts + layer.shared
            n = sum(affine(e.w1, e.b1) + affine(e.w2, e.b2) + affine(e.w3, e.b3) for e in experts)
            n += affine(layer.router_weight, layer.router_bias) + affine(layer.shared_gate, None)
            pruned = [int(r) for r in np.flatnonzero(layer.expert_map < 0)]
            e0 = layer.experts[0]
            weights = [layer.router_weight] + [w for e in experts for w in (e.w1, e.w2, e.w3) if w is not None]
            row.update(
                shape=f"{layer.d_model}->{layer.d_model}", params=n, dtype=_storage(weights)
                + (" int8-act" if any(e.int8_act for e in experts) else "")
                + (" int8-blocks" if any(e.int8_blocks for e in experts) else ""),
                routing=layer.routing.name.lower(), top_k=layer.top_k, renormalize=layer.renormalize,
                experts=len(layer.experts), router_outputs=layer.route_count, pruned=pruned,
                expert=f"{e0.kind.name.lower()} {e0.act.name.lower()} hidden {e0.hidden}",
                shared=len(layer.shared), shared_gate=layer.shared_gate is not None,
            )
        else:
            row.update(shape="", params=0)
        params += row["params"]
        layers.append(row)
    moes = graph.moe_layers()
    return {
        "image_bytes": len(data),
        "arena_bytes": engine.arena_size(data),
        "input_size": graph.input_size, "output_size": graph.output_size, "max_batch": graph.max_batch,
        "parameters": params,
        "routed_experts": sum(len(m.experts) for m in moes),
        "shared_experts": sum(len(m.shared) for m in moes),
        "vocab_size": graph.vocab_size,
        "kv_cache_bytes": kv_cache,
        "tokenizer": _tokenizer(graph),
        "layers": layers,
    }


def _tokenizer(graph) -> dict | None:
    """The tokenizer section (format v6): kind, tokens, special ids (with their text), merges."""
    from ..image.tokenizer_section import parse

    if graph.tokenizer is None:
        return None
    section = parse(graph.tokenizer, graph.vocab_size)
    return {"kind": section.kind.name.lower(), "vocab_size": section.vocab_size,
            "unused": int((section.types == F.TokenType.UNUSED).sum()),
            "special": {name: {"id": v, "text": section.tokens[v].decode("utf-8", "replace")}
                        for name, v in section.specials().items()},
            "merges": len(section.merges), "summary": section.summary()}


def _map_model(path: Path) -> mmap.mmap:
    """The file mapped read-only, with no readahead around the pages that are touched (MADV_RANDOM),
    so reading the tables pages in the tables and not the weights beside them. Left to the garbage
    collector to unmap: the graph read from it holds views into it (and an error's traceback may)."""
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            raise error_for(F.Status.TRUNCATED, f"{path} is empty")
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_RANDOM"):  # Linux, macOS
        mapped.madvise(mmap.MADV_RANDOM)
    return mapped


@main.command()
@click.argument("image_path", metavar="IMAGE", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def info(image_path: Path, as_json: bool) -> None:
    """Show the layers, experts, routing, parameters and memory of a model image.

    Reads its tables, not its weights: the file is mapped and its structure checked; `colibri verify`
    checks the payloads."""
    from rich.console import Console
    from rich.table import Table

    d = describe(_map_model(image_path))
    if as_json:
        click.echo(json.dumps(d, indent=2))
        return
    table = Table(title=f"{image_path.name}")
    for col in ("#", "layer", "shape", "weights", "params", "details"):
        table.add_column(col)
    for i, row in enumerate(d["layers"]):
        details = ""
        if row["op"] == "MoE":
            details = (f"{row['routing']} k={row['top_k']}{' renorm' if row['renormalize'] else ''}, "
                       f"{row['experts']}/{row['router_outputs']} experts ({row['expert']})"
                       f"{', pruned ' + str(row['pruned']) if row['pruned'] else ''}"
                       f"{', shared ' + str(row['shared']) if row['shared'] else ''}"
                       f"{' gated' if row['shared_gate'] else ''}")
        elif row["op"] == "Attention":
            details = row["attention"]
        elif row.get("tied"):
            details = "tied to the embedding (its weights counted there)"
        table.add_row(str(i), row["op"], row["shape"], row["dtype"], f"{row['params']:,}", details)
    console = Console()
    if not console.is_terminal:  # piped: do not wrap the table at 80 columns
        console = Console(width=160)
    console.print(table)
    console.print(
        f"input {d['input_size']}  output {d['output_size']}  max batch {d['max_batch']}  "
        f"parameters {d['parameters']:,}  routed experts {d['routed_experts']}  shared {d['shared_experts']}\n"
        f"image {d['image_bytes']:,} bytes  arena {d['arena_bytes']:,} bytes"
        + (f" (KV cache {d['kv_cache_bytes']:,} of them)  vocabulary {d['vocab_size']:,} tokens"
           if d["vocab_size"] else "")
        + (f"\ntokenizer {d['tokenizer']['summary']}" if d["tokenizer"] else
           "\ntokenizer none (colibri generate --tokenizer gives one)" if d["vocab_size"] else "")
    )


@main.command()
@click.argument("image_path", metavar="IMAGE", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def verify(image_path: Path) -> None:
    """Verify every byte of a model image: header, tables, every tensor payload against its CRC
    (format v3: one per tensor; v1, v2: the image CRC), by the C engine and the Python reader."""
    from ..runtime import engine
    from .. import image

    with open(image_path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            raise error_for(F.Status.TRUNCATED, f"{image_path} is empty")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            with memoryview(data) as view:
                st_c = engine.image_status(view)
                st_py = image.status(view)
            version = int.from_bytes(data[4:6], "little")
            tensors = int.from_bytes(data[32:36], "little")
    if st_c != st_py:
        raise ColibriError(f"{image_path}: the C engine says {st_c}, the Python reader {st_py} (please report)")
    if st_c:
        raise error_for(st_c, str(image_path))
    what = f"{tensors} tensor CRCs" if version >= F.TENSOR_CRC_VERSION else "image CRC"
    click.echo(f"{image_path}: ok (format v{version}, {size:,} bytes, {what} verified)")


@main.command("gen-header", hidden=True)  # for maintainers (make header), not in the user's list
@click.option("--check", is_flag=True, help="Exit 1 if the header is out of date instead of writing it.")
def gen_header(check: bool) -> None:
    """Regenerate firmware/colibri_core/include/colibri_format.h from colibri.model.format."""
    from ..runtime import sources

    path = sources.root() / "firmware/colibri_core/include/colibri_format.h"
    text = F.c_header()
    if check:
        if not path.exists() or path.read_text() != text:
            raise ColibriError(f"{path} is out of date: run `colibri gen-header`")
        return
    if sources.checkout_root() is None:
        raise ColibriError("gen-header rewrites a checkout's header: run it in a Colibri checkout (--check works anywhere)")
    path.write_text(text)
    click.echo(f"wrote {path}")

"""Chat prompts for `colibri generate --chat`: the model's chat template, rendered by transformers.

The template is a host-side input: the image's tokenizer section (docs/lm.md) holds what encoding
and decoding need and has no field for a template, so it is read from where the model came from:
a Hugging Face folder (`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`), a
GGUF file (`tokenizer.chat_template`), a tokenizer_config.json or a template file of its own.

Rendering is transformers' (`transformers.utils.chat_template_utils.render_jinja_template`, the
sandboxed jinja2 environment `apply_chat_template` uses), with the user's prompt as the one user
message, the generation prompt added, and the section's special tokens as `bos_token`,
`eos_token`, `pad_token` and `unk_token`. The rendered text is encoded with the image's tokenizer:
the text of each special (control) token the template writes becomes that token's id, the text
between them is encoded by the tokenizer's library as text of its own.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from ..model.errors import ColibriError, MissingExtraError
from ..model.format import TokenType

TEMPLATE_FILE = "chat_template.jinja"


def load_template(source: str | Path) -> str:
    """The chat template at `source` (a folder, a GGUF file, a tokenizer_config.json or a template
    file); a ColibriError naming the source when it has none."""
    path = Path(source)
    if path.is_dir():
        if (path / TEMPLATE_FILE).is_file():
            return (path / TEMPLATE_FILE).read_text()
        config = path / "tokenizer_config.json"
        if not config.is_file():
            raise ColibriError(f"{path}: no chat template (no {TEMPLATE_FILE} and no tokenizer_config.json)")
        return _from_config(config)
    if not path.is_file():
        raise ColibriError(f"{path}: no such chat template file, folder or GGUF file")
    from .gguf_file import is_gguf

    if is_gguf(path):
        from .gguf_reader import tokenizer_metadata

        tok = tokenizer_metadata(path)
        if tok is None or not tok.chat_template:
            raise ColibriError(f"{path}: the GGUF file has no tokenizer.chat_template")
        return tok.chat_template
    if path.suffix == ".json":
        return _from_config(path)
    return path.read_text()


def _from_config(config: Path) -> str:
    try:
        template = json.loads(config.read_text()).get("chat_template")
    except (ValueError, AttributeError) as exc:
        raise ColibriError(f"{config}: not a tokenizer_config.json ({exc})") from None
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise ColibriError(f"{config}: no chat_template")
    return template


def special_texts(section) -> dict[str, str]:
    """bos_token, eos_token, ... as the template sees them: the section's special tokens' text."""
    out = {}
    for name, token in section.specials().items():
        out[f"{name}_token"] = section.tokens[token].decode("utf-8", "replace")
    return out


def render(template: str, prompt: str, section) -> str:
    """The chat of one user message `prompt`, with the generation prompt, as the template writes it."""
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError as exc:  # pragma: no cover - the tokenizer extra installs it
        raise MissingExtraError("rendering a chat template (colibri generate --chat)", "transformers",
                                "tokenizer") from exc
    try:
        rendered, _ = render_jinja_template(conversations=[[{"role": "user", "content": prompt}]],
                                            chat_template=template, add_generation_prompt=True,
                                            **special_texts(section))
    except Exception as exc:  # jinja2's TemplateError, and what a template raises itself (raise_exception)
        raise ColibriError(f"the chat template does not render: {type(exc).__name__}: {exc}") from None
    return rendered[0]


def encode(text: str, tokenizer) -> list[int]:
    """`text` (a rendered chat) to ids: each control token's text to its id, the text between
    them through `tokenizer` (a `SectionTokenizer`)."""
    section = tokenizer.section
    controls = {section.tokens[i].decode("utf-8", "replace"): i for i in range(section.vocab_size)
                if section.types[i] == TokenType.CONTROL and section.tokens[i]}
    if not controls:
        return tokenizer.encode(text) if text else []
    pattern = re.compile("|".join(re.escape(t) for t in sorted(controls, key=len, reverse=True)))
    ids: list[int] = []
    at = 0
    for match in pattern.finditer(text):
        if match.start() > at:
            ids += tokenizer.encode(text[at:match.start()])
        ids.append(controls[match.group()])
        at = match.end()
    if at < len(text):
        ids += tokenizer.encode(text[at:])
    return ids

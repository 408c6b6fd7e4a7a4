"""`colibri generate --chat` (colibri.checkpoints.chat_template; issue 26): the model's chat template, from the
folder or the GGUF file the image came from, rendered by transformers around the prompt; the
rendered chat's special tokens become their ids. Compared with transformers' own
`apply_chat_template` on the folder's tokenizer; refused clearly where there is no template."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from transformers import PreTrainedTokenizerFast

import colibri
from colibri.checkpoints import hf_folder
from colibri.cli import main
from colibri.checkpoints import chat_template as chat
from helpers import tokenizers_trained as trained
from helpers.gguf_files import write_gguf
from helpers.hf_lm_models import mixtral

CHATML = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|endoftext|>assistant\n{% endif %}")
INST = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
        "{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """kind -> (the folder with its chat template, the image exported from it)."""
    root = tmp_path_factory.mktemp("chat")
    out = {}
    for kind, vocab, write, template in (("bpe", 401, trained.byte_bpe, CHATML),
                                         ("sp", 600, trained.sentencepiece_model, INST)):
        folder = root / kind
        model = mixtral(vocab)
        model.save_pretrained(folder, safe_serialization=True)
        write(folder)
        config = folder / "tokenizer_config.json"
        settings = json.loads(config.read_text()) if config.is_file() else {}
        config.write_text(json.dumps({**settings, "chat_template": template}))
        image = root / f"{kind}.clb"
        hf_folder.export_folder(folder, image, max_seq_len=64)
        out[kind] = folder, image
    return out


def test_byte_bpe_chat_is_transformers_apply_chat_template(images):
    folder, image = images["bpe"]
    lm = colibri.LM(image)
    prompt = "Grüße 🎉, how are you?"
    rendered = chat.render(chat.load_template(folder), prompt, lm.tokenizer.section)
    reference = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), chat_template=CHATML,
                                        eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    messages = [{"role": "user", "content": prompt}]
    assert rendered == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat.encode(rendered, lm.tokenizer) == list(want)
    assert rendered.startswith("<|endoftext|>user\n") and chat.encode(rendered, lm.tokenizer)[0] == 0


def test_sentencepiece_chat_writes_bos_as_its_id(images):
    import sentencepiece

    folder, image = images["sp"]
    lm = colibri.LM(image)
    rendered = chat.render(chat.load_template(folder), "Köln 🦜", lm.tokenizer.section)
    assert rendered == "<s>[INST] Köln 🦜 [/INST]"
    sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    assert chat.encode(rendered, lm.tokenizer) == [1, *sp.encode("[INST] Köln 🦜 [/INST]")]


def test_cli_generate_chat_from_the_folder_and_from_the_gguf(images, tmp_path):
    folder, image = images["sp"]
    runner = CliRunner()
    lm = colibri.LM(image)
    ids = chat.encode("<s>[INST] hi [/INST]", lm.tokenizer)
    want = lm.decode(lm.generate(ids, 5))
    res = runner.invoke(main, ["generate", str(image), "--prompt", "hi", "-n", "5", "--chat-template", str(folder)])
    assert res.exit_code == 0, res.output
    assert res.output == "<s>[INST] hi [/INST]" + want + "\n"
    gguf = write_gguf(mixtral(600), tmp_path / "m.gguf", tokenizer=folder)  # the converter copies the template
    res = runner.invoke(main, ["generate", str(image), "-p", "hi", "-n", "5", "--chat", "--chat-template", str(gguf),
                               "--no-echo"])
    assert res.exit_code == 0, res.output
    assert res.output == want + "\n"
    jinja = tmp_path / "t.jinja"
    jinja.write_text(INST)
    res = runner.invoke(main, ["generate", str(image), "-p", "hi", "-n", "5", "--chat-template", str(jinja)])
    assert res.exit_code == 0 and res.output == "<s>[INST] hi [/INST]" + want + "\n"


def test_refused_without_a_template(images, tmp_path):
    folder, image = images["sp"]
    runner = CliRunner()
    res = runner.invoke(main, ["generate", str(image), "-p", "hi", "--chat"])
    assert res.exit_code != 0 and "--chat needs --chat-template" in res.output
    assert "holds no chat template" in res.output
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer_config.json").write_text("{}")
    res = runner.invoke(main, ["generate", str(image), "-p", "hi", "--chat-template", str(bare)])
    assert res.exit_code != 0 and "tokenizer_config.json: no chat_template" in res.output
    gguf = write_gguf(mixtral(600), tmp_path / "plain.gguf")
    res = runner.invoke(main, ["generate", str(image), "-p", "hi", "--chat-template", str(gguf)])
    assert res.exit_code != 0 and "has no tokenizer.chat_template" in res.output
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    res = runner.invoke(main, ["generate", str(image), "-p", "hi", "--chat-template", str(broken)])
    assert res.exit_code != 0 and "the chat template does not render: TemplateSyntaxError" in res.output
    plain = tmp_path / "plain.clb"
    hf_folder.export_folder(folder, plain, max_seq_len=16, tokenizer=False)
    res = runner.invoke(main, ["generate", str(plain), "-p", "hi", "--chat-template", str(folder)])
    assert res.exit_code != 0 and "--chat needs the image's own tokenizer" in res.output

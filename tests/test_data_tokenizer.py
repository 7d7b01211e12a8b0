"""Tokenizers behind one interface (meshpar/data/tokenizer.py): a Hugging Face tokenizer.json gives
exactly the ids of the ``tokenizers`` library, its EOS / BOS come from the folder's config, bad specs
are RecipeErrors naming the fix; and a checkpoint keeps its run's tokenizer, which
``meshpar convert --to hf`` writes into the Hugging Face folder, where transformers loads it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from meshpar import convert as cv
from meshpar.checkpoint import Checkpointer, RunState
from meshpar.config.errors import RecipeError
from meshpar.config.recipe import CheckpointConfig
from meshpar.data import BatchLoader
from meshpar.data.tokenizer import EOT, BPETokenizer, ByteTokenizer, HFTokenizer, document_ids, load_tokenizer
from meshpar.models.llama import LLAMA_SIZES, Transformer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # a save without a process group

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
DOCS = ["The quick brown fox jumps over the lazy dog.\n", "Zwölf Boxkämpfer jagen Viktor quer über den Sylter Deich.",
        "日本語のテキスト、そして emoji 🦊🚀 too.", "def f(x):\n    return x ** 2  # code\n\n\n",
        "  leading spaces\ttab"]
TEXTS = [*DOCS, "", " ", f"a literal {EOS} inside", "ñ" * 50]


def tiny_tokenizer(specials: tuple[str, ...] = (BOS, EOS), *, truncate: int = 0) -> tokenizers.Tokenizer:
    """A byte-level BPE of 320 ids trained on DOCS, with a Llama 3 style post-processor adding BOS."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS * 4, trainers.BpeTrainer(vocab_size=320, special_tokens=list(specials),
                                                          show_progress=False,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if BOS in specials:
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    if truncate:
        tok.enable_truncation(truncate)
    return tok


def model_folder(path: Path, config: dict | None = None, **kwargs) -> Path:
    """``path`` as a Hugging Face model folder holds a tokenizer: tokenizer.json (+ tokenizer_config.json)."""
    path.mkdir(parents=True, exist_ok=True)
    tiny_tokenizer(**kwargs).save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def reference_ids(file: Path, text: str) -> list[int]:
    tok = tokenizers.Tokenizer.from_file(str(file))
    tok.no_truncation()
    return tok.encode(text, add_special_tokens=False).ids


def test_hf_tokenizer_gives_the_ids_of_tokenizers(tmp_path):
    folder = model_folder(tmp_path / "model", {"bos_token": BOS, "eos_token": {"content": EOS, "special": True}})
    tok = load_tokenizer(str(folder))
    assert isinstance(tok, HFTokenizer)
    file = folder / "tokenizer.json"
    assert [tok.encode(t) for t in TEXTS] == [reference_ids(file, t) for t in TEXTS]
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    assert tok.encode(DOCS[2]) and tok.decode(tok.encode(DOCS[2])) == DOCS[2]  # lossless, unicode included
    assert (tok.bos_id, tok.eos_id) == (tok.tok.token_to_id(BOS), tok.tok.token_to_id(EOS)) == (0, 1)
    assert tok.vocab_size == tok.tok.get_vocab_size(with_added_tokens=True) and f"(vocab {tok.vocab_size})" in tok.name
    assert document_ids(tok, DOCS[:2]) == [[0, *tok.encode(d), 1] for d in DOCS[:2]]
    # the file itself as the spec: the same tokenizer, config beside it included
    same = load_tokenizer(str(file))
    assert (same.fingerprint(), same.bos_id, same.eos_id) == (tok.fingerprint(), 0, 1)
    assert same.encode_batch(TEXTS) == tok.encode_batch(TEXTS)
    assert len(tok.fingerprint()) == 64
    # a file that switches truncation on still gives whole documents
    cut = load_tokenizer(str(model_folder(tmp_path / "cut", {"eos_token": EOS}, truncate=4)))
    assert cut.encode(DOCS[0]) == tok.encode(DOCS[0]) and len(cut.encode(DOCS[0])) > 4
    assert cut.fingerprint() != tok.fingerprint()
    # built without a config (from a token cache entry): its files still name the eos / bos it uses
    bare = HFTokenizer(file.read_bytes(), tokenizers.Tokenizer.from_file(str(file)), {}, 1, 0, "cache")
    assert json.loads(bare.hf_files()["tokenizer_config.json"]) == {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": BOS}


@pytest.mark.parametrize("config, specials, bos, eos", [
    (None, (BOS, EOS), None, EOS),  # no config: the first end-of-text token the vocabulary has
    (None, ("</s>", EOT), None, EOT),  # <|endoftext|> comes first
    ({"bos_token": BOS, "add_bos_token": False, "eos_token": EOS}, (BOS, EOS), None, EOS),  # GPT-2 style
    ({"bos_token": None, "eos_token": "</s>"}, (BOS, EOS, "</s>"), None, "</s>"),  # Qwen2 style
])
def test_eos_and_bos_from_the_config_or_the_vocabulary(tmp_path, config, specials, bos, eos):
    tok = load_tokenizer(str(model_folder(tmp_path, config, specials=specials)))
    assert tok.bos_id == (None if bos is None else tok.tok.token_to_id(bos))
    assert tok.eos_id == tok.tok.token_to_id(eos)
    assert document_ids(tok, ["ab"]) == [[*tok.encode("ab"), tok.eos_id]]


def test_special_tokens_map_names_eos_when_the_config_does_not(tmp_path):
    folder = model_folder(tmp_path, {"model_max_length": 64}, specials=(BOS, EOS, "</s>"))
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    tok = load_tokenizer(str(folder))
    assert tok.eos_id == tok.tok.token_to_id("</s>")
    assert json.loads(tok.hf_files()["tokenizer_config.json"])["eos_token"] == "</s>"  # kept with the checkpoint


def bad_specs(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """Broken tokenizer specs -> (spec, a phrase of the message)."""
    sentencepiece = tmp_path / "sp"
    sentencepiece.mkdir()
    (sentencepiece / "tokenizer.model").write_bytes(b"\x0a\x05")
    (sentencepiece / "tokenizer_config.json").write_text("{}")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
    not_utf8 = tmp_path / "binary.json"
    not_utf8.write_bytes(b"\xff\xfe\x00")
    bad_config = model_folder(tmp_path / "bad_config", specials=(BOS, EOS))
    (bad_config / "tokenizer_config.json").write_text("{not json")
    unknown_eos = model_folder(tmp_path / "unknown_eos", {"eos_token": "<|im_end|>"})
    return {
        "missing": (str(tmp_path / "nowhere"), "no such file or folder"),
        "no tokenizer.json": (str(sentencepiece), "holds tokenizer.model, tokenizer_config.json, but meshpar reads "
                                                  "only the fast-tokenizer format"),
        "corrupt": (str(corrupt), "is not a tokenizer.json the tokenizers library can read"),
        "not utf-8": (str(not_utf8), "is not a tokenizer.json the tokenizers library can read"),
        "bad config": (str(bad_config), "is not readable JSON"),
        "no eos": (str(model_folder(tmp_path / "no_eos", specials=(BOS,))), "no end-of-text token"),
        "unknown eos": (str(unknown_eos), "eos_token '<|im_end|>' is not in the vocabulary"),
    }


def test_unusable_tokenizers_are_one_line_recipe_errors(tmp_path):
    for case, (spec, phrase) in bad_specs(tmp_path).items():
        with pytest.raises(RecipeError) as e:
            load_tokenizer(spec)
        message = str(e.value)
        assert e.value.key == "data.tokenizer" and "\n" not in message, case
        assert message.startswith(f"data.tokenizer = {spec!r}: ") and phrase in message, (case, message)
        if case == "no tokenizer.json":
            assert "save_pretrained" in message
    with pytest.raises(RecipeError) as e:
        load_tokenizer(str(tmp_path / "nowhere"), key="eval.tokenizer")
    assert e.value.key == "eval.tokenizer"


def test_byte_and_bpe_have_the_same_interface():
    bpe = BPETokenizer.train(DOCS, 300)
    long = "\n".join(f"line {i}: {DOCS[i % len(DOCS)].strip()}" for i in range(3000))  # > CHUNK_CHARS: in pieces
    assert len(long) > 1 << 16
    assert bpe.encode_batch([*TEXTS, long]) == [bpe.encode(t) for t in [*TEXTS, long]]
    assert (bpe.eos_id, bpe.bos_id) == (bpe.tok.token_to_id(EOT), None)
    assert document_ids(bpe, DOCS[:2]) == [[*bpe.encode(d), bpe.eos_id] for d in DOCS[:2]]
    config = json.loads(bpe.hf_files()["tokenizer_config.json"])
    assert config == {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT, "bos_token": None}
    byte = ByteTokenizer()
    assert (byte.eos_id, byte.bos_id, byte.hf_files()) == (None, None, {})
    assert byte.encode_batch(DOCS) == [list(d.encode()) for d in DOCS]
    with pytest.raises(ValueError, match="no end-of-text id"):
        document_ids(byte, DOCS)


# --- checkpoints keep the tokenizer; `meshpar convert --to hf` writes it ----------------------------------------
def save_step(root: Path, tokenizer_files: dict[str, bytes] | None) -> Path:
    """A one-rank checkpoint of a one-block debug Llama through the Checkpointer training uses."""
    args = dataclasses.replace(LLAMA_SIZES["debug"], n_layers=1, max_seq_len=512)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    loader = BatchLoader(np.arange(1000, dtype=np.uint16), seq_len=16, global_batch=2, micro_batch=2, dp_rank=0,
                         dp_size=1, seed=0)
    run = RunState(torch.nn.ModuleList([model]), model.state_dict, optimizer, scheduler, loader)
    layout = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}
    info = {"family": "llama", "size": "custom", "model_args": dataclasses.asdict(args), "layout": layout}
    ckpt = Checkpointer(CheckpointConfig(), root, rank=0, world_size=1, info=json.loads(json.dumps(info)),
                        recipe_toml="[model]\n", tokenizer_files=tokenizer_files, log=lambda line: None)
    ckpt.save(run, 1)
    return root / "step_1"


def transformers_ids(folder: Path, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only extra")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    return [tok(t, add_special_tokens=add_special_tokens)["input_ids"] for t in texts]


def test_checkpoint_keeps_the_bpe_tokenizer_and_convert_writes_it(tmp_path, capsys):
    bpe = BPETokenizer.train(DOCS, 300)
    step = save_step(tmp_path / "ckpt", bpe.hf_files())
    assert (step / "tokenizer.json").read_bytes() == bpe.tok.to_str().encode()
    hf = tmp_path / "hf"
    cv.convert(step, hf, "hf")
    assert "no tokenizer" not in capsys.readouterr().out
    config = json.loads((hf / "tokenizer_config.json").read_text())
    assert config == {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT, "bos_token": None,
                      "model_max_length": 512}
    tok = load_tokenizer(str(hf))
    assert (tok.eos_id, tok.bos_id, tok.vocab_size) == (bpe.eot_id, None, bpe.vocab_size)
    assert tok.encode_batch(TEXTS) == [bpe.encode(t) for t in TEXTS]
    ids = [reference_ids(hf / "tokenizer.json", t) for t in TEXTS]
    assert transformers_ids(hf, TEXTS, True) == transformers_ids(hf, TEXTS, False) == ids  # no post-processor
    # a re-chunked checkpoint keeps it too
    cv.convert(step, tmp_path / "dcp", "dcp", layout={"tp": 2}, progress=False)
    assert (tmp_path / "dcp" / "tokenizer.json").read_bytes() == (step / "tokenizer.json").read_bytes()


def test_hugging_face_tokenizer_round_trips_through_checkpoint_and_convert(tmp_path):
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "model_max_length": 131072, "chat_template": "{{ messages }}"}
    source = load_tokenizer(str(model_folder(tmp_path / "llama3", config)))
    hf = tmp_path / "hf"
    cv.convert(save_step(tmp_path / "ckpt", source.hf_files()), hf, "hf", progress=False)
    tok = load_tokenizer(str(hf))
    assert (tok.fingerprint(), tok.bos_id, tok.eos_id) == (source.fingerprint(), 0, 1)  # the very bytes
    assert json.loads((hf / "tokenizer_config.json").read_text()) == {**config, "model_max_length": 512}
    file = tmp_path / "llama3" / "tokenizer.json"
    # with special tokens the file's own post-processor adds BOS, in transformers as in tokenizers
    with_bos = [tokenizers.Tokenizer.from_file(str(file)).encode(t).ids for t in TEXTS]
    assert all(ids[0] == 0 for ids in with_bos)
    assert transformers_ids(hf, TEXTS, True) == with_bos
    assert transformers_ids(hf, TEXTS, False) == [reference_ids(file, t) for t in TEXTS]
    # Hugging Face -> DCP -> Hugging Face keeps it as well
    cv.convert(hf, tmp_path / "dcp", "dcp", progress=False)
    cv.convert(tmp_path / "dcp", tmp_path / "hf2", "hf", progress=False)
    assert load_tokenizer(str(tmp_path / "hf2")).fingerprint() == source.fingerprint()


def test_convert_says_when_there_is_no_tokenizer(tmp_path, capsys):
    step = save_step(tmp_path / "ckpt", None)
    assert not (step / "tokenizer.json").exists()
    summary = cv.convert(step, tmp_path / "hf", "hf")
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == summary.note and out[-1].startswith(f"meshpar convert: no tokenizer written: {step} has no "
                                                          f"tokenizer.json")
    assert "tokenizer_config.json" in summary.note and not (tmp_path / "hf" / "tokenizer.json").exists()
    with pytest.raises(ValueError, match="are not tokenizer files"):
        save_step(tmp_path / "other", {"meshpar.json": b"{}"})

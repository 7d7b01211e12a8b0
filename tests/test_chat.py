"""Chat templates and the assistant's tokens (meshpar/data/chat.py): ids equal to transformers'
``apply_chat_template`` on the same tokenizer folder, for a ChatML template, a Llama-3-style one
(BOS, trim, raise_exception) and one with ``{% generation %}`` blocks, whose assistant mask
transformers computes too; masks by hand on a small conversation; the errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshpar.data.chat import ChatTemplate, ChatTemplateError, assistant_spans, encode_conversation, messages_of

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{% if message['role'] not in ['system', 'user', 'assistant'] %}"
          "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
          "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + "
          "'<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
GENERATION = ("{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
              "{% generation %}{{ message['content'] + '<|im_end|>\n' }}{% endgeneration %}{% else %}"
              "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>"]
CONVERSATION = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a prime. Ünïcode & <html> too."},
                {"role": "assistant", "content": "Seven."},
                {"role": "user", "content": "Another?"},
                {"role": "assistant", "content": " Eleven, then thirteen. "}]


def _tokenizer():
    """A small byte-level BPE with the templates' special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [json.dumps(CONVERSATION)] * 4 + ["the quick brown fox jumps over the lazy dog " * 8]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _folder(tmp_path: Path, template: str) -> Path:
    """A Hugging Face tokenizer folder with ``template``, written by transformers itself."""
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=_tokenizer(), bos_token="<|begin_of_text|>",
                                                eos_token="<|im_end|>")
    fast.chat_template = template
    folder = tmp_path / "tok"
    fast.save_pretrained(folder)
    return folder


@pytest.mark.slow  # imports transformers (seconds)
@pytest.mark.parametrize("template", [CHATML, LLAMA3, GENERATION], ids=["chatml", "llama3", "generation"])
def test_ids_equal_transformers_apply_chat_template(tmp_path, template):
    import transformers
    from tokenizers import Tokenizer

    folder = _folder(tmp_path, template)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    ours = ChatTemplate.from_folder(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for messages in (CONVERSATION, CONVERSATION[1:3]):
        ids, trained = encode_conversation(tok, ours, messages)
        want = theirs.apply_chat_template(messages, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=template == GENERATION)
        assert ids == list(want["input_ids"]), (theirs.decode(ids), theirs.decode(want["input_ids"]))
        if template == GENERATION:  # transformers' mask from the template's own generation blocks
            assert [bool(m) for m in want["assistant_masks"]] == trained
        assert ours.render(messages, add_generation_prompt=True) == theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)


def test_the_assistants_turns_are_trained_and_nothing_else():
    template = ChatTemplate(CHATML)
    text, spans = assistant_spans(template, CONVERSATION)
    assert [text[s:e] for s, e in spans] == ["Seven.<|im_end|>\n", " Eleven, then thirteen. <|im_end|>\n"]
    tok = _tokenizer()
    ids, trained = encode_conversation(tok, template, CONVERSATION)
    kept = tok.decode([i for i, t in zip(ids, trained, strict=True) if t], skip_special_tokens=False)
    assert kept == "Seven.<|im_end|>\n Eleven, then thirteen. <|im_end|>\n"
    assert not any(trained[:ids.index(tok.token_to_id("<|im_end|>")) + 1])  # the system turn


def test_rows_prompt_completion_and_messages():
    assert messages_of({"prompt": "2+2?", "completion": "4"}) == [{"role": "user", "content": "2+2?"},
                                                                  {"role": "assistant", "content": "4"}]
    assert messages_of({"messages": CONVERSATION[:2]}) == CONVERSATION[:2]
    with pytest.raises(ChatTemplateError, match="needs 'messages', or 'prompt' and 'completion'"):
        messages_of({"text": "hello"})


def test_errors_name_the_template_and_the_reason(tmp_path):
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        ChatTemplate(LLAMA3, {"bos_token": "<|begin_of_text|>"}).render([{"role": "tool", "content": "x"}])
    rewrites = ChatTemplate("{% for m in messages %}{% if loop.last %}{{ m['content'] }}{% endif %}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="rewrites earlier turns"):
        assistant_spans(rewrites, CONVERSATION)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTemplate.from_folder(tmp_path)

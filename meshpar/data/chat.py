"""Chat data for supervised fine-tuning: a tokenizer's chat template rendered as transformers renders
it, and which tokens of a conversation are the assistant's (the ones a fine-tune trains on).

    template = ChatTemplate.from_folder("path/to/hf_folder")     # tokenizer_config.json's chat_template
    ids, trained = encode_conversation(tokenizer, template, [{"role": "user", "content": "Hi"},
                                                             {"role": "assistant", "content": "Hello!"}])

[Note: rendering a chat template]
Chat templates are Jinja, rendered as transformers' ``apply_chat_template`` renders them so that the
ids are the same: a sandboxed environment (templates come from downloaded folders) with
``trim_blocks`` and ``lstrip_blocks``, the loop-control extension, a ``tojson`` filter that leaves
non-ASCII characters and HTML as they are, ``raise_exception`` and ``strftime_now``, the special
tokens (``bos_token``, ``eos_token``, ...) as text, and ``{% generation %}`` blocks accepted (their
body rendered as is). The rendered text is tokenized without adding special tokens: the template
wrote them.

[Note: the assistant's tokens]
A conversation is rendered once, whole. For each assistant message i, the text of messages[:i]
with the generation prompt ends where its reply starts, and the text of messages[:i + 1] ends
where the reply and what the template closes it with (its end-of-turn token) end: the characters
between are trained. A token is trained when its first character is. A template whose prefixes do
not render as prefixes of the whole (one that rewrites earlier turns, for example dropping past
reasoning) is refused, since its masks would be wrong.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """A template that cannot be used, or a conversation it refuses: the message names which and why."""


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: the body, rendered as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A chat template and the special tokens it may name: [Note: rendering a chat template]."""

    def __init__(self, source: str, special: Mapping[str, str] | None = None, where: str = "the template") -> None:
        import jinja2

        self.source, self.special, self.where = source, dict(special or {}), where
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{where}: the chat template is not valid Jinja (line {e.lineno}: {e.message})") \
                from None

    @classmethod
    def from_folder(cls, folder: str | Path, template_file: str | Path | None = None) -> ChatTemplate:
        """The template of a Hugging Face tokenizer folder: ``template_file`` when given, else
        ``chat_template.jinja``, else tokenizer_config.json's ``chat_template`` (a string, or named
        templates: the ``default``); with the folder's special tokens either way."""
        folder = Path(folder)
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        special = {k: _text(config.get(k)) for k in SPECIAL if _text(config.get(k)) is not None}
        if template_file is not None:
            return cls(Path(template_file).read_text(), special, str(template_file))
        if (folder / "chat_template.jinja").is_file():
            return cls((folder / "chat_template.jinja").read_text(), special, str(folder / "chat_template.jinja"))
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str):
            raise ChatTemplateError(f"{folder}: no chat template (no chat_template.jinja, and tokenizer_config.json "
                                    "has no chat_template string or 'default' template); use a tokenizer folder of "
                                    "an instruction-tuned model, or prompt / completion rows with such a folder")
        return cls(template, special, str(config_path))

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False) -> str:
        import jinja2

        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         **self.special)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"{self.where}: the chat template refused the conversation: {e}") from None


def _text(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: text, or {"content": text, ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def messages_of(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A row's conversation: its ``messages`` (role, content), or its ``prompt`` and ``completion``
    as one user turn and one assistant turn."""
    if row.get("messages") is not None:  # a Parquet table of both kinds of rows holds None in the other's columns
        messages = row["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ChatTemplateError("a row's 'messages' must be a list of {role, content} objects")
        return messages
    if row.get("prompt") is not None and row.get("completion") is not None:
        return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
    raise ChatTemplateError(f"a chat row needs 'messages', or 'prompt' and 'completion'; this one has "
                            f"{sorted(row)}")


def assistant_spans(template: ChatTemplate, messages: Sequence[Mapping[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
    """(the conversation rendered, the character spans of the assistant's turns): [Note: the
    assistant's tokens]."""
    whole = template.render(messages)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = template.render(messages[:i], add_generation_prompt=True)
        end = template.render(messages[:i + 1])
        if not (whole.startswith(start) and whole.startswith(end) and len(start) <= len(end)):
            raise ChatTemplateError(f"{template.where}: the chat template does not render the turns before "
                                    f"message {i} as the start of the whole conversation (it rewrites earlier "
                                    "turns), so the assistant's tokens cannot be found; use a template that appends "
                                    "each turn")
        spans.append((len(start), len(end)))
    return whole, spans


def encode_conversation(tokenizer: Any, template: ChatTemplate,
                        messages: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[bool]]:
    """The conversation's token ids (what transformers' ``apply_chat_template`` gives) and, per
    token, whether it is the assistant's: ``tokenizer`` a ``tokenizers.Tokenizer``."""
    return encode_conversations(tokenizer, template, [messages])[0]


def encode_conversations(tokenizer: Any, template: ChatTemplate, conversations: Sequence[Sequence[Mapping[str, Any]]]
                         ) -> list[tuple[list[int], list[bool]]]:
    """``encode_conversation`` of each, tokenized in one parallel batch."""
    rendered = [assistant_spans(template, messages) for messages in conversations]
    encodings = tokenizer.encode_batch([text for text, _ in rendered], add_special_tokens=False)
    out = []
    for (_, spans), encoding in zip(rendered, encodings, strict=True):
        out.append((list(encoding.ids), [any(s <= start < e for s, e in spans) for start, _ in encoding.offsets]))
    return out


# meshpar's template for tokenizers that bring none (bpe): role markers as plain text, a turn per line group
PLAIN_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def choose_separator(tokenizer: Any, template: ChatTemplate, eos_id: int | None) -> int | None:
    """The id that ends each conversation in a packed stream ([Note: packing conversations] in
    meshpar/data/packing.py): the first of the pad token, ``eos_id`` and the tokenizer's other special
    tokens that the template does not write into a conversation (a template that ends each turn with
    the EOS, as many do, would otherwise split its conversations apart under document attention).
    None when every special token appears."""
    probe = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "Bye."}, {"role": "assistant", "content": "Bye."}]
    written = set(tokenizer.encode(template.render(probe), add_special_tokens=False).ids)
    names = [template.special.get("pad_token")] + [tokenizer.id_to_token(eos_id) if eos_id is not None else None]
    names += [t.content for _, t in sorted(tokenizer.get_added_tokens_decoder().items()) if t.special]
    for name in names:
        i = tokenizer.token_to_id(name) if name else None
        if i is not None and i not in written:
            return i
    return None


def dialogues(text: str, turns: int = 4) -> list[list[dict[str, str]]]:
    """The built-in corpus's plays as conversations: within each scene, consecutive speeches
    alternate user and assistant, ``turns`` messages a conversation (the built-in chat data)."""
    out, speeches = [], []

    def flush() -> None:
        for i in range(0, len(speeches) - turns + 1, turns):
            out.append([{"role": "user" if j % 2 == 0 else "assistant", "content": speeches[i + j]}
                        for j in range(turns)])
        speeches.clear()

    for block in text.split("\n\n"):
        lines = block.strip().splitlines()
        if not lines:
            continue
        if lines[0].startswith(("ACT ", "SCENE ")) or "\n\n\n" in block:
            flush()
        elif lines[0].endswith(":") and lines[0][:-1].replace(" ", "").isupper() and len(lines) > 1:
            speeches.append("\n".join(lines[1:]))
    flush()
    return out

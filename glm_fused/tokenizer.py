"""Tokenizer of a Hugging Face checkpoint directory, without transformers.

``tokenizer.json`` runs on the ``tokenizers`` library; the chat template (from
``tokenizer_config.json`` or ``chat_template.jinja``) renders in a sandboxed Jinja
environment set up the way transformers sets it up, so prompts match byte for byte.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

from glm_fused.errors import UserError

def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string or an AddedToken-like dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _make_environment():
    """The Jinja environment chat templates are written for (transformers' settings)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training
        masks in transformers; rendering only needs the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class Tokenizer:
    """Encode, decode and chat-format for the checkpoint in ``model_dir``."""

    def __init__(self, model_dir: str | Path, chat_template: str | Path | None = None):
        """``chat_template``: a Jinja file that replaces the checkpoint's template (``--chat-template``)."""
        from tokenizers import Tokenizer as _Backend

        self.model_dir = Path(model_dir)
        tokenizer_file = self.model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise UserError(f"no tokenizer.json in {self.model_dir} (a fast tokenizer is required)")
        try:
            self._tok = _Backend.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises plain Exception
            raise UserError(f"cannot load {tokenizer_file}: {exc}") from None

        config_file = self.model_dir / "tokenizer_config.json"
        self._config = _read_json(config_file) if config_file.is_file() else {}
        if chat_template is not None:
            path = Path(chat_template).expanduser()
            try:
                self._template_source, self._template_file = path.read_text(encoding="utf-8"), path
            except (OSError, UnicodeDecodeError) as exc:
                raise UserError(f"--chat-template {chat_template}: cannot read it ({exc})") from None
        else:
            self._template_source, self._template_file = self._find_template(config_file)
        self._template = None  # compiled on first use

        self.special_ids: set[int] = {
            i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special
        }
        self.eos_token_ids: set[int] = self._collect_eos_ids()

    # ------------------------------------------------------------------ set-up

    def _find_template(self, config_file: Path) -> tuple[str | None, Path]:
        # Newer checkpoints keep the template in its own file, which then wins.
        jinja_file = self.model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            try:
                return jinja_file.read_text(encoding="utf-8"), jinja_file
            except OSError as exc:
                raise UserError(f"cannot read {jinja_file}: {exc}") from None
        template = self._config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise UserError(f"{config_file}: chat_template must be a string")
        return template, config_file

    def _collect_eos_ids(self) -> set[int]:
        """Every id that ends generation: generation_config.json, config.json and the
        tokenizer's eos_token together (GLM lists several: endoftext, user, observation)."""
        ids: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            path = self.model_dir / name
            if path.is_file():
                ids.update(_as_id_list(_read_json(path).get("eos_token_id")))
        eos = _token_text(self._config.get("eos_token"))
        if eos is not None and (eos_id := self.token_to_id(eos)) is not None:
            ids.add(eos_id)
        return ids

    # ------------------------------------------------------------------ tokens

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` underneath (for libraries that read the vocabulary)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer can produce, added tokens included (<= the model's vocab)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocab_strings(self) -> list[str]:
        """Every token as the vocabulary spells it, added tokens included."""
        return list(self._tok.get_vocab(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of text. Special-token strings in text (e.g. from a chat template)
        become their single ids. add_special_tokens runs tokenizer.json's post-processor."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def text_stream(self, skip_special_tokens: bool = True) -> "TextStream":
        """An incremental decoder for one generated sequence."""
        return TextStream(self, skip_special_tokens)

    # ------------------------------------------------------------------ chat

    @property
    def chat_template(self) -> str | None:
        """The Jinja source of the chat template in use."""
        return self._template_source

    def special_token(self, name: str) -> str | None:
        """A special token of ``tokenizer_config.json`` (``eos_token``, ``bos_token``...), as text."""
        return _token_text(self._config.get(name))

    @property
    def has_chat_template(self) -> bool:
        return self._template_source is not None

    def _compiled_template(self):
        if self._template is None:
            if self._template_source is None:
                raise UserError(
                    f"{self.model_dir} has no chat template (looked in chat_template.jinja and "
                    "tokenizer_config.json)"
                )
            import jinja2

            try:
                self._template = _make_environment().from_string(self._template_source)
            except jinja2.TemplateSyntaxError as exc:
                raise UserError(
                    f"bad chat template in {self._template_file}: line {exc.lineno}: {exc.message}"
                ) from None
        return self._template

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for messages (OpenAI-style dicts), ready for encode().

        Extra keyword arguments reach the template as variables, as in transformers.
        """
        import jinja2

        template = self._compiled_template()
        variables = {key: text for key in ("bos_token", "eos_token", "pad_token", "unk_token")
                     if (text := self.special_token(key)) is not None}
        variables.update(kwargs)
        try:
            return template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                enable_thinking=enable_thinking,
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise UserError(f"chat template of {self._template_file} failed: {exc}") from None
        except (TypeError, ValueError, AttributeError, KeyError) as exc:
            raise UserError(
                f"chat template of {self._template_file} failed on these messages: {exc}"
            ) from None


class TextStream:
    """Text of a growing token sequence, emitted piece by piece for streaming.

    ``tokenizers``' own ``DecodeStream`` does the work: decoding tokens one at a time is wrong
    for byte-level BPE (a character can span tokens) and for tokenizers whose spacing depends
    on the previous token, and it handles both, holding back text that ends in an
    incomplete UTF-8 sequence until the next token completes it (it gives the same pieces as
    decoding a window of recent tokens did here before; tests/test_tiny_tokenizer_model_path.py
    checks every prefix against a full decode). What it cannot do is end: ``flush`` shows the
    ids still held back as ``decode`` shows them (U+FFFD for an unfinished character).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self._backend = tokenizer.backend
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []  # ids whose text is not out yet

    def step(self, token_id: int) -> str:
        """Add one generated id; return the new text to show (often '', never partial)."""
        text = self._stream.step(self._backend, int(token_id))
        if text is None:
            self._held.append(int(token_id))
            return ""
        self._held.clear()
        return text

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character decodes as U+FFFD)."""
        held, self._held = self._held, []
        return self._backend.decode(held, skip_special_tokens=self._skip) if held else ""

"""The target's tokenizer for the serving processes, read without transformers.

A decoder or predictor start spent 1.5-2 s of a 2-core CPU importing transformers for the
tokenizer alone (its own model code is plain torch), on the critical path of every start
and every crash recovery. Where the target's tokenizer is generic (transformers' class for
it only wraps tokenizer.json), the `tokenizers` library reads the same file and the chat
template renders in a jinja2 sandbox set up as transformers sets it up; tests compare both
(ids of chats, raw prompts, decoded text). Anything else (a clean-up pass, named templates,
extra special tokens, a BOS/EOS rule in the config, another class) loads the full
transformers tokenizer (models.load_tokenizer).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

# tokenizer classes that read tokenizer.json and tokenizer_config.json alone
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                "mask_token")


class FileTokenizer:
    """A generic tokenizer's tokenizer.json through `tokenizers`: encode and decode as
    transformers does (its own class wraps this very object)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.backend = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
        self.size = self.backend.get_vocab_size(with_added_tokens=True)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self.size

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.backend.encode(
            text, add_special_tokens=add_special_tokens).ids}


class ChatTokenizer(FileTokenizer):
    """FileTokenizer plus the config's special tokens and its chat template: what the decoder
    asks of a tokenizer (models.encode_prompt / encode_chat, eos_token_ids)."""

    def __init__(self, path: Path, config: dict, template: str | None) -> None:
        super().__init__(path)
        self.special = {k: _content(config[k]) for k in SPECIAL_KEYS
                        if _content(config.get(k)) is not None}
        eos = self.special.get("eos_token")
        self.eos_token_id = self.backend.token_to_id(eos) if eos is not None else None
        self.chat_template = template
        self._compiled = None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, tools: list[dict] | None = None
                            ) -> list[int] | str:
        if self._compiled is None:
            self._compiled = _sandbox().from_string(self.chat_template)
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        text = self._compiled.render(messages=chat, tools=tools, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **self.special)
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text


def _content(value: object) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _sandbox():  # noqa: ANN202
    """jinja2's sandbox with transformers' settings: trimmed blocks, loop controls, its
    `tojson` (no HTML escaping), `raise_exception`, `strftime_now`."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: object, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _generic_config(path: Path) -> dict | None:
    """tokenizer_config.json when the folder's tokenizer is all in tokenizer.json and no
    clean-up pass rewrites decoded text; else None."""
    try:
        config = json.loads((Path(path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("tokenizer_class") not in GENERIC_TOKENIZERS \
            or config.get("clean_up_tokenization_spaces") \
            or not (Path(path) / "tokenizer.json").is_file():
        return None
    return config


def _template(path: Path, config: dict) -> str | None | bool:
    """The chat template (None: the tokenizer has none); False where it is in a form this
    module does not render (named templates), so the full tokenizer is used."""
    file = Path(path) / "chat_template.jinja"
    if file.is_file():
        return file.read_text()
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    return False


def serving_tokenizer(path: Path):  # noqa: ANN201
    """The light tokenizer for `path` where it gives transformers' ids and text, else None."""
    config = _generic_config(path)
    # transformers rewrites the file's post-processor for add_bos/add_eos_token, and
    # passes extra special tokens to the template: its own tokenizer does those
    if config is None or config.get("extra_special_tokens") \
            or config.get("additional_special_tokens") \
            or "add_bos_token" in config or "add_eos_token" in config:
        return None
    template = _template(path, config)
    if template is False:
        return None
    try:
        return ChatTokenizer(path, config, template)
    except Exception:  # noqa: BLE001 - the full loader says what is wrong, in one line
        return None

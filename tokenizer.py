"""Tokenizers for checkpoint directories: HF `tokenizer.json` or SentencePiece `tokenizer.model`.

Also rebuilds a GGUF file's embedded tokenizer as real tokenizer files (`write_tokenizer_from_gguf`),
so a checkpoint converted from GGUF is self-describing. Runtime dependencies: `tokenizers`,
`sentencepiece` (+ `protobuf` for SentencePiece models), `jinja2` for chat templates.
"""
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Optional

from errors import TokenizerError, one_line


def _token_content(token, key: str) -> Optional[str]:
    # tokenizer_config.json writes special tokens either as strings or as {"content": ...} dicts
    content = token.get("content") if isinstance(token, dict) else token
    if content is not None and not isinstance(content, str):
        raise TokenizerError(f"tokenizer_config.json: {key} is {token!r:.60}, expected a token's text")
    return content


def _read_json(path: Path) -> dict:
    """A tokenizer JSON file that must hold an object, or a one-line TokenizerError."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TokenizerError(f"cannot read {path}: {one_line(e)}") from None
    if not isinstance(obj, dict):
        raise TokenizerError(f"{path} does not hold a JSON object")
    return obj


def _chat_template(config: dict) -> Optional[str]:
    """tokenizer_config.json's chat_template: a string, or named templates of which "default" is used."""
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        if not all(isinstance(t, dict) and "name" in t and "template" in t for t in template):
            raise TokenizerError("tokenizer_config.json: chat_template is a list whose entries are not "
                                 "{\"name\": ..., \"template\": ...}")
        template = {t["name"]: t["template"] for t in template}.get("default")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"tokenizer_config.json: chat_template is {template!r:.60}, expected a string")
    return template or None


class Tokenizer:
    def __init__(self, checkpoint_dir):
        checkpoint_dir = Path(checkpoint_dir)
        config_path = checkpoint_dir / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}

        if (checkpoint_dir / "tokenizer.json").is_file():
            self._load_hf(checkpoint_dir / "tokenizer.json")
        elif (checkpoint_dir / "tokenizer.model").is_file():
            self._load_sentencepiece(checkpoint_dir / "tokenizer.model")
        else:
            raise TokenizerError(
                f"no tokenizer found in {checkpoint_dir}: expected tokenizer.json (Hugging Face tokenizers) "
                "or tokenizer.model (SentencePiece). Copy them from the original model, or convert a GGUF "
                "file, which rebuilds them from its embedded tokenizer."
            )

        bos = _token_content(config.get("bos_token"), "bos_token")
        eos = _token_content(config.get("eos_token"), "eos_token")
        self.bos_id = self._token_id(bos) if bos else self._default_bos_id
        eos_id = self._token_id(eos) if eos else self._default_eos_id
        self.eos_ids = [eos_id] if eos_id is not None else []
        self.add_bos = bool(config.get("add_bos_token", self._default_add_bos)) and self.bos_id is not None
        self.bos_token = bos if bos else (self._id_to_token(self.bos_id) if self.bos_id is not None else None)
        self.eos_token = eos if eos else (self._id_to_token(eos_id) if eos_id is not None else None)

        self.chat_template = None
        template_path = checkpoint_dir / "chat_template.jinja"
        if template_path.is_file():
            try:
                self.chat_template = template_path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"cannot read {template_path}: {one_line(e)}") from None
        else:
            self.chat_template = _chat_template(config)

    # --- backends -------------------------------------------------------------------------------

    def _load_hf(self, path):
        import tokenizers

        try:
            self._hf = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:
            raise TokenizerError(f"cannot load {path}: {one_line(e)}") from e
        self._sp = None
        self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
        self._default_bos_id = self._default_eos_id = None
        # tokenizer.json has no add_bos flag of its own: it adds BOS only through its post-processor
        plain = self._hf.encode("a", add_special_tokens=False).ids
        with_special = self._hf.encode("a", add_special_tokens=True).ids
        added_in_front = with_special[: len(with_special) - len(plain)]
        self._default_add_bos = bool(added_in_front)
        if added_in_front:
            self._default_bos_id = added_in_front[0]

    def _load_sentencepiece(self, path):
        import sentencepiece as spm

        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
            proto = _parse_sentencepiece_proto(self._sp.serialized_model_proto())
        except TokenizerError:
            raise
        except Exception as e:
            raise TokenizerError(f"cannot load SentencePiece model {path}: {one_line(e)}") from e
        if not all(isinstance(p.piece, str) for p in proto.pieces):  # protobuf hands back invalid UTF-8 as bytes
            raise TokenizerError(f"cannot load SentencePiece model {path}: a piece is not valid UTF-8")
        self._hf = None
        self.vocab_size = self._sp.get_piece_size()
        self._default_bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self._default_eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None
        self._default_add_bos = True  # llama-style SentencePiece models start with BOS
        self._dummy_prefix = proto.normalizer_spec.add_dummy_prefix
        self._sp_no_prefix = self._sp
        if self._dummy_prefix:
            # text after a special token gets no dummy prefix (as transformers' Metaspace "first" scheme)
            proto.normalizer_spec.add_dummy_prefix = False
            self._sp_no_prefix = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        # control and user-defined pieces written as text become their ids
        self._special_pieces = {p.piece: i for i, p in enumerate(proto.pieces) if p.type in (3, 4) and p.piece}
        self._special_ids = {i for i, p in enumerate(proto.pieces) if p.type in (2, 3, 4)}
        pattern = "|".join(re.escape(p) for p in sorted(self._special_pieces, key=len, reverse=True))
        self._special_re = re.compile(f"({pattern})") if pattern else None

    def _token_id(self, token: str) -> int:
        token_id = self._hf.token_to_id(token) if self._hf else self._sp.piece_to_id(token)
        if token_id is None or (self._sp and self._sp.id_to_piece(token_id) != token):
            raise TokenizerError(f"special token {token!r} from tokenizer_config.json is not in the vocabulary")
        return token_id

    def _id_to_token(self, token_id: int) -> str:
        return self._hf.id_to_token(token_id) if self._hf else self._sp.id_to_piece(token_id)

    def text_ids(self) -> set:
        """Ids that encoding text can give (special tokens excluded), plus BOS and EOS."""
        if self._hf is not None:
            special = {i for i, t in self._hf.get_added_tokens_decoder().items() if t.special}
            ids = set(self._hf.get_vocab(with_added_tokens=True).values()) - special
        else:  # SentencePiece: control pieces are the special ones
            ids = set(range(self.vocab_size)) - self._special_ids
        return ids | {i for i in (self.bos_id, *self.eos_ids) if i is not None}

    # --- encode / decode ------------------------------------------------------------------------

    def encode(self, text: str, add_bos: Optional[bool] = None) -> list[int]:
        add_bos = self.add_bos if add_bos is None else add_bos
        if self._hf:
            ids = self._hf.encode(text, add_special_tokens=False).ids
        else:
            ids = self._encode_sentencepiece(text)
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def _encode_sentencepiece(self, text: str) -> list[int]:
        parts = self._special_re.split(text) if self._special_re else [text]
        ids = []
        for i, part in enumerate(parts):
            if i % 2 == 1:  # odd parts are the matched special tokens
                ids.append(self._special_pieces[part])
            elif part:
                ids.extend((self._sp if i == 0 else self._sp_no_prefix).encode(part))
        return ids

    def decode(self, ids: list[int]) -> str:
        ids = [int(i) for i in ids]
        if self._hf:
            return self._hf.decode(ids, skip_special_tokens=False)
        # Decode piece by piece so control/user-defined tokens show as their text, as in tokenizer.json
        # decoders (sentencepiece itself would drop control tokens).
        out = bytearray()
        for i in ids:
            piece = self._sp.id_to_piece(i)
            if self._sp.is_byte(i):
                out.append(int(piece[3:5], 16))  # "<0xAB>"
            else:
                out += (piece if i in self._special_ids else piece.replace("\u2581", " ")).encode()
        text = out.decode("utf-8", errors="replace")
        if self._dummy_prefix and text.startswith(" "):
            text = text[1:]  # the dummy prefix that encode added
        return text

    # --- chat -----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: Optional[list] = None) -> str:
        """The conversation as the checkpoint's template writes it. `tools`: the functions the model may
        call, as transformers passes them ({"type": "function", "function": {...}} each); templates that
        describe no tools ignore them."""
        if not self.chat_template:
            raise TokenizerError(
                "this tokenizer has no chat template (no chat_template.jinja and no chat_template in "
                "tokenizer_config.json): it is probably a base model; prompt it with plain text instead"
            )
        try:
            template = _compile_chat_template(self.chat_template)
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                tools=tools,
                xml_tools=tools,  # SmolLM3's template reads its tools from `xml_tools`, not `tools`
                documents=None,
            )
        except Exception as e:  # the template is the checkpoint's code: any error in it is the checkpoint's
            raise TokenizerError(f"chat template failed: {one_line(e)}") from e


def _compile_chat_template(source: str):
    # Same environment as transformers' apply_chat_template, so rendered prompts are identical.
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which chat templates do not expect
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class StreamDecoder:
    """Incremental detokenization: the pushed pieces concatenate to exactly tokenizer.decode(all ids).

    Each step decodes a short window, ids[prefix_offset:], and prints what it adds to the already
    printed part ids[prefix_offset:read_offset]; decoding the same leading tokens keeps
    whitespace handling (SentencePiece's dummy prefix) identical in both, and a trailing U+FFFD
    means an incomplete UTF-8 character (byte-fallback / byte-level tokens), so it is held back.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: already printed context
        self.read_offset = 0  # ids before this are printed

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        printed = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(text) <= len(printed) or text.endswith("\ufffd") or not text.startswith(printed):
            return ""
        # the tokens just printed become the next window's context (empty only at the very start)
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return text[len(printed) :]

    def flush(self) -> str:
        printed = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(printed) :]


class StopStrings:
    """A sequence's text as tokens arrive, cut where a stop string begins (the stop string and what
    follows are not part of the output, and a stop string may span tokens). What may still turn
    out to begin a stop string is held back: `ready()` is the text that can go out now."""

    def __init__(self, tokenizer, stops=()):
        self.decoder, self.stops = StreamDecoder(tokenizer), [s for s in stops if s]
        self.text, self.stopped = "", False

    def push(self, token_id: int) -> bool:
        """Add a token's text; True when a stop string has appeared (the text now ends before it)."""
        if self.stopped:
            return True
        start = max(0, len(self.text) - max((len(s) for s in self.stops), default=0))
        self.text += self.decoder.push(token_id)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True
        return self.stopped

    def finish(self) -> str:
        """The whole text, once no more tokens come."""
        if not self.stopped:
            self.text += self.decoder.flush()  # an incomplete character held back until now
            hits = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[:min(hits)], True
        return self.text

    def ready(self) -> str:
        """The text so far less its end that may begin a stop string."""
        if self.stopped:
            return self.text
        held = max((k for s in self.stops for k in range(min(len(s) - 1, len(self.text)), 0, -1)
                    if self.text.endswith(s[:k])), default=0)
        return self.text[:len(self.text) - held]


# --- GGUF -> tokenizer files ------------------------------------------------------------------

# tokenizer.ggml.pre -> how text is split before byte-level BPE
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3's tokenizer.json (SmolLM3 too): digits in runs of up to three; llama.cpp splits its
# llama-bpe, smaug-bpe and dbrx pre-tokenizers with this one regex
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (gpt-oss, Phi-4-mini: llama.cpp's gpt-4o): case runs split words ("HelloWorld" -> "Hello",
# "World"), a contraction stays on its word, and a punctuation run takes a following "/" with newlines
_GPT4O_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)


def _byte_level_pre_tokenizer(pre: str):
    from tokenizers import Regex, normalizers, pre_tokenizers

    # smollm: SmolLM2's tokenizer.json; refact (Granite's GGUFs): llama.cpp splits it the same way
    if pre in ("smollm", "refact"):  # every digit alone, then the GPT-2 regex
        return None, pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre == "qwen2":  # Qwen2's tokenizer.json (which also NFC-normalizes)
        return normalizers.NFC(), pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in ("llama-bpe", "smaug-bpe", "dbrx"):
        return None, pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre == "gpt-4o":
        return None, pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_GPT4O_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in ("gpt-2", "default", "olmo"):  # llama.cpp splits OLMo's "olmo" with the GPT-2 regex
        return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raise TokenizerError(
        f"GGUF byte-level BPE tokenizer with pre-tokenizer {pre!r} is not supported "
        "(supported: smollm, refact, qwen2, llama-bpe, smaug-bpe, dbrx, gpt-4o, gpt-2, olmo)"
    )


def gguf_field(reader, key: str, default=None):
    """One GGUF metadata value (gguf.GGUFReader), or default; the converter reads its fields here too."""
    field = reader.get_field(key)
    if field is None:
        return default
    try:
        value = field.contents()
    except (UnicodeDecodeError, IndexError) as e:  # a corrupted string or array
        raise TokenizerError(f"GGUF metadata {key} is unreadable ({one_line(e)})") from None
    # GGUF floats are float32: give 1e-05, not 9.999999747378752e-06
    return float(f"{value:.7g}") if isinstance(value, float) else value


def _gguf_typed(reader, key: str, kind: type, default=None, items: type = None, length: int = None):
    """A tokenizer metadata value of the expected type (a list: of `items`, `length` long), or default."""
    value = gguf_field(reader, key)
    if value is None:
        return default
    if items is float and isinstance(value, list):
        value = [float(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in value]
    wrong = not isinstance(value, kind) or (kind is int and isinstance(value, bool))
    if not wrong and items is not None:
        wrong = not all(isinstance(v, items) and not isinstance(v, bool) for v in value)
    if wrong:
        shown = repr(value) if len(repr(value)) < 40 else repr(value)[:37] + "..."
        raise TokenizerError(f"GGUF metadata {key} is {shown}, expected "
                             f"{'a list of ' + items.__name__ if items else kind.__name__}")
    if length is not None and len(value) != length:
        raise TokenizerError(f"GGUF metadata {key} has {len(value)} entries for {length} tokens")
    return value


def write_tokenizer_from_gguf(reader, out_dir) -> None:
    """Write the tokenizer embedded in a GGUF file (gguf.GGUFReader) as tokenizer files in out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kind = _gguf_typed(reader, "tokenizer.ggml.model", str)
    tokens = _gguf_typed(reader, "tokenizer.ggml.tokens", list, items=str)
    if kind is None or not tokens:
        raise TokenizerError("the GGUF file has no embedded tokenizer (no tokenizer.ggml.model / tokens)")
    token_types = _gguf_typed(reader, "tokenizer.ggml.token_type", list, None, int, len(tokens)) or [1] * len(tokens)
    if not all(1 <= t <= 6 for t in token_types):
        raise TokenizerError("GGUF metadata tokenizer.ggml.token_type holds a type outside 1..6")

    if kind == "gpt2":
        _write_byte_level_bpe(reader, tokens, token_types, out_dir)
    elif kind == "llama":
        _write_sentencepiece(reader, tokens, token_types, out_dir)
    else:
        raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)")

    config = {}
    for key, name in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("pad_token", "padding_token_id")):
        token_id = _gguf_typed(reader, f"tokenizer.ggml.{name}", int)
        if token_id is not None and 0 <= token_id < len(tokens):
            config[key] = tokens[token_id]
    add_bos = gguf_field(reader, "tokenizer.ggml.add_bos_token")
    config["add_bos_token"] = bool(add_bos) if add_bos is not None else kind == "llama"
    template = _gguf_typed(reader, "tokenizer.chat_template", str)
    if template:
        config["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _write_byte_level_bpe(reader, tokens, token_types, out_dir):
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as HFTokenizer

    merges = _gguf_typed(reader, "tokenizer.ggml.merges", list, items=str)
    if merges is None:
        raise TokenizerError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")
    if not all(" " in m for m in merges):
        raise TokenizerError("GGUF metadata tokenizer.ggml.merges holds an entry that is not two tokens")
    normalizer, pre_tokenizer = _byte_level_pre_tokenizer(_gguf_typed(reader, "tokenizer.ggml.pre", str, "default"))
    vocab = {token: i for i, token in enumerate(tokens)}
    try:
        tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges]))
    except Exception as e:  # tokenizers' own check, e.g. a merge of tokens not in the vocabulary
        raise TokenizerError(f"the GGUF's BPE tokenizer could not be rebuilt: {one_line(e)}") from None
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    # control (3) and user-defined (4) tokens are matched whole in the text, before BPE
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=(t == 3), normalized=False)
            for i, t in enumerate(token_types)
            if t in (3, 4)
        ]
    )
    try:
        tokenizer.save(str(out_dir / "tokenizer.json"))
    except Exception as e:  # tokenizers reports a failed write (a full disk) as a bare Exception
        raise TokenizerError(f"cannot write {out_dir / 'tokenizer.json'}: {one_line(e)}") from None


def _parse_sentencepiece_proto(serialized: bytes):
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError as e:
        raise TokenizerError(f"SentencePiece models need the protobuf package (pip install protobuf): {one_line(e)}") from e
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(serialized)
    return proto


def _write_sentencepiece(reader, tokens, token_types, out_dir):
    import sentencepiece as spm

    proto = _parse_sentencepiece_proto(b"")
    scores = _gguf_typed(reader, "tokenizer.ggml.scores", list, None, float, len(tokens)) or [0.0] * len(tokens)
    # GGUF token types use SentencePiece's numbering: 1 normal, 2 unknown, 3 control, 4 user-defined,
    # 5 unused, 6 byte
    for i, (token, score, token_type) in enumerate(zip(tokens, scores, token_types)):
        if token_type == 4 and " " in token and not token.strip():
            # Gemma's runs of spaces: llama.cpp stores them as user-defined "  ", but they are
            # ordinary pieces "▁▁" that BPE merges (so 40 spaces become 16 + 24, not 31 + 9, as in
            # transformers). Their rank is their position in the file, ahead of every scored piece.
            token, score, token_type = "\u2581" * len(token), len(tokens) - i, 1
        piece = proto.pieces.add()
        piece.piece, piece.score, piece.type = token, float(score), int(token_type)

    trainer = proto.trainer_spec
    trainer.model_type = 2  # BPE: llama.cpp's SPM tokenizer merges by piece score, as SentencePiece BPE does
    trainer.vocab_size = len(tokens)
    trainer.byte_fallback = 6 in token_types
    for name, default in (("unk", 0), ("bos", 1), ("eos", 2), ("pad", -1)):
        key = f"tokenizer.ggml.{'padding' if name == 'pad' else name}_token_id"
        token_id = _gguf_typed(reader, key, int)
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise TokenizerError(f"GGUF metadata {key} is {token_id}, outside the vocabulary of {len(tokens)}")
        setattr(trainer, f"{name}_id", token_id if token_id is not None else default)
    if trainer.unk_id >= 0 and token_types[trainer.unk_id] != 2:
        trainer.unk_id = next((i for i, t in enumerate(token_types) if t == 2), 0)
    for name in ("unk", "bos", "eos", "pad"):
        token_id = getattr(trainer, f"{name}_id")
        if 0 <= token_id < len(tokens):
            setattr(trainer, f"{name}_piece", tokens[token_id])

    # Llama / Gemma normalization: none (identity), whitespace escaped as U+2581
    normalizer = proto.normalizer_spec
    normalizer.name = "identity"
    normalizer.add_dummy_prefix = bool(gguf_field(reader, "tokenizer.ggml.add_space_prefix", True))
    normalizer.remove_extra_whitespaces = False
    normalizer.escape_whitespaces = True

    serialized = proto.SerializeToString()
    try:
        spm.SentencePieceProcessor(model_proto=serialized)  # fail here, not when the model is used
    except Exception as e:
        raise TokenizerError(f"the GGUF's SentencePiece tokenizer could not be rebuilt: {one_line(e)}") from e
    (out_dir / "tokenizer.model").write_bytes(serialized)

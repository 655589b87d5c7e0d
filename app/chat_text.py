"""The conversation as tokens (the tokenizer's chat template) and tokens back as text, piece by piece."""


def decode(tokenizer, ids: list[int]) -> str:
    """Text of token ids without special tokens (chat markers are not shown)."""
    try:
        return tokenizer.decode(ids, skip_special_tokens=True)
    except TypeError:
        return tokenizer.decode(ids)


class PieceDecoder:
    """Token ids -> text pieces, one per token (held back while a multi-byte character is incomplete).

    Each token is decoded with a few tokens of left context so that leading spaces come out right for
    both SentencePiece and byte-level BPE tokenizers.
    """

    def __init__(self, tokenizer, context: int = 4):
        self.tokenizer = tokenizer
        self.context = context
        self.done: list[int] = []
        self.pending: list[tuple[int, bool]] = []

    def _decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids) if ids else ""

    def add(self, token: int, from_draft: bool) -> tuple[str, bool] | None:
        self.pending.append((token, from_draft))
        ctx = self.done[-self.context :]
        ids = [t for t, _ in self.pending]
        prefix = self._decode(ctx)
        full = self._decode(ctx + ids)
        if full.endswith("\ufffd") and len(self.pending) < 6:
            return None  # an incomplete UTF-8 sequence: wait for the next token
        text = full[len(prefix) :] if full.startswith(prefix) else self._decode(ids)
        draft = all(d for _, d in self.pending)
        self.done += ids
        self.pending = []
        return (text, draft) if text else None

    def flush(self) -> tuple[str, bool] | None:
        if not self.pending:
            return None
        ids = [t for t, _ in self.pending]
        draft = all(d for _, d in self.pending)
        self.done += ids
        self.pending = []
        text = self._decode(ids)
        return (text, draft) if text else None


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """The conversation through the tokenizer's chat template (plain text when it has none)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict):  # some tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return list(tokenizer.encode(text))

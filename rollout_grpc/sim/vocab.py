"""Toy byte-level vocabulary standing in for the tiny models' 2048-token BPE tokenizer.

The real tiny models (reference §9.4) use a byte-level BPE with eight special tokens at ids 0-7.
The simulator keeps those ids exactly, so clients that hard-code ``<|im_end|>`` = 2 or build
multimodal placeholders from ``<|image_pad|>`` = 6 behave identically, then adds one token per
byte (so every string is encodable) and a fixed list of multi-character pieces so decoded output
looks like text rather than noise. Encoding is greedy longest match, which is deterministic and
cheap; it is not BPE, and nothing in the service may depend on the exact segmentation.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
BOS_ID = 0
IM_START_ID = 1
EOS_ID = 2
PAD_ID = 3
VISION_START_ID = 4
VISION_END_ID = 5
IMAGE_PAD_ID = 6
VIDEO_PAD_ID = 7
NUM_SPECIAL = len(SPECIAL_TOKENS)
#: The smallest vocabulary: the special tokens and one token per byte.
MIN_VOCAB_SIZE = NUM_SPECIAL + 256
BYTE_OFFSET = NUM_SPECIAL


def _words(text: str) -> list[str]:
    return text.split()


# A fixed word list: every entry yields the bare piece and a space-prefixed one, which is what a
# byte-level BPE trained on English and Python ends up with for frequent words.
_WORDS = _words("""
the of and to in is that for it as was with be by on not he this are or his from at which but
have an they you were her she there one all we their been has will would who more if no out so
said what up its about into than them can only other new some could time these two may then do
first any my now such like our over man me even most made after also did many before must
through back years where much your way well down should because each just those people how too
little state good very make world still own see men work long get here between both life being
under never day same another know while last might us great old year off come since against go
came right used take three states himself few house use during without again place around
however home small found thought went say part once general high upon school every does got
united left number course war until always away something fact though water less public put
think almost hand enough far took head yet government system better set told nothing night end
why called didn eyes find going look asked later knew point next program city business give
group toward young days let room president side social present given several order national
possible rather second face per among form important often things looking early white case john
become large big need four within felt along children saw best church ever least power
development light thing seemed family interest want members mind country area others done turned
although open god service certain kind problem began different door thus help sense means whole
matter perhaps itself york times law human line above name example action company hands local
show whether five history gave today either act feet across taken past quite anything seen death
experience body half really week words field car already information tell together college shall
money period held keep sure probably free seems real behind cannot miss political air question
making office brought whose special heard major problems ago became federal moment study available
known result street economic boy position reason change south board individual job society areas
west close turn love community true court force full seem am policy wife future age voice center
woman control common necessary following front sometimes six girl clear further land run students
provide feel party able mother music education university short child usually low art surface
def return import class self none true false elif else while lambda yield async await raise try
except finally with assert pass break continue global nonlocal print len range list dict str int
float bool tuple set object type value values key keys items item index data args kwargs init
path file name names line lines text string bytes buffer token tokens model models request
response error errors result results config options param params state status count size length
start stop begin end step steps sample samples batch output input prompt logprob logprobs
weight weights version versions engine server client stream chunk chunks message messages
format parse load save read write open close append extend update delete create build test
tests check assert_equal expected actual default missing invalid valid number numbers float32
int64 array matrix vector tensor shape dtype device layer layers expert experts router routing
hello world answer question think thinking reasoning because therefore compute calculate sum
plus minus times divided equals zero three four five six seven eight nine ten hundred thousand
""")

_FRAGMENTS = _words("""
ing ed er es ly tion ment ness able ible al ous ive ful less est ism ist ity ize ise ance ence
th sh ch st nd nt ng re in on at en an or ar ou ea ee oo ie ai ay ow ew ck ll ss tt pp rr
un de con pro pre dis mis com sub inter trans over under out up anti auto bi co counter ex
ion ation ition ical ically ular ative ature ory ery ary ent ant ong ang ight ough
""")

_PUNCT = [
    "\n\n",
    "\n    ",
    "\n        ",
    "    ",
    "        ",
    " =",
    " ==",
    " !=",
    " +",
    " -",
    " *",
    " /",
    "()",
    "):",
    "),",
    "])",
    "['",
    "']",
    '("',
    '")',
    ", ",
    ". ",
    ".\n",
    ":\n",
    " (",
    " [",
    " {",
    "});",
    " ->",
    " #",
    "...",
    " '",
    ' "',
    "__",
    "\t",
    " \n",
]


def _pieces(count: int) -> list[bytes]:
    """The multi-character pieces, deterministic for a given count (no randomness anywhere)."""
    seen: set[bytes] = set()
    out: list[bytes] = []

    def add(piece: str) -> None:
        raw = piece.encode("utf-8")
        if len(raw) > 1 and raw not in seen and len(out) < count:
            seen.add(raw)
            out.append(raw)

    for word in _WORDS:
        add(" " + word)
        add(word)
    for p in _PUNCT:
        add(p)
    for word in _WORDS:
        add(" " + word.capitalize())
    for frag in _FRAGMENTS:
        add(frag)
        add(" " + frag)
    for word in _WORDS:
        add(word.capitalize())
        add(word + ".")
        add(word + ",")
    # Filler for vocabularies larger than the word list: syllable combinations.
    consonants = "bcdfghjklmnprstvwz"
    vowels = "aeiou"
    n = 0
    while len(out) < count:
        c1 = consonants[n % len(consonants)]
        v = vowels[(n // len(consonants)) % len(vowels)]
        c2 = consonants[(n // (len(consonants) * len(vowels))) % len(consonants)]
        tail = n // (len(consonants) * len(vowels) * len(consonants))
        piece = c1 + v + c2 + (str(tail) if tail else "")
        add(piece)
        add(" " + piece)
        n += 1
    return out


def _token_text(raw: bytes) -> str:
    """``tokenizer.decode([id])`` as vLLM reports it in logprobs: a token ending in an incomplete
    UTF-8 sequence (a lone byte of a multi-byte character) decodes to ``""``."""
    text = raw.decode("utf-8", errors="replace")
    return "" if text.endswith("\ufffd") else text


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to U+0100 onwards."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), 256),
    ]
    table: dict[int, str] = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


_BYTE_ALPHABET = _byte_alphabet()


class Vocab:
    """Token id <-> bytes table with greedy longest-match encoding.

    Ids 0-7 are the special tokens, 8-263 are single bytes, the rest are multi-byte pieces. The
    minimum vocabulary is 264 (specials plus bytes).
    """

    def __init__(self, vocab_size: int = 2048) -> None:
        if vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
        self.size = vocab_size
        table: list[bytes] = [s.encode() for s in SPECIAL_TOKENS]
        table.extend(bytes([b]) for b in range(256))
        table.extend(_pieces(vocab_size - len(table)))
        self.token_bytes: list[bytes] = table
        self._lookup: dict[bytes, int] = {}
        for i in range(NUM_SPECIAL, vocab_size):
            self._lookup.setdefault(table[i], i)
        self._max_piece = max(len(b) for b in table[NUM_SPECIAL:])
        self._special_lookup = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
        # Token strings as the HF tokenizer would show them in `token_strs`/OpenAI logprobs: the
        # text of the token (invalid UTF-8 fragments decode to U+FFFD like the real detokenizer).
        self.token_text: list[str] = [_token_text(b) for b in table]

    @property
    def eos_id(self) -> int:
        return EOS_ID

    @property
    def bos_id(self) -> int:
        return BOS_ID

    def is_special(self, token_id: int) -> bool:
        return 0 <= token_id < NUM_SPECIAL

    def encode(self, text: str) -> list[int]:
        """Greedy longest-match encoding; special-token strings in the text become their ids."""
        ids: list[int] = []
        pos = 0
        n = len(text)
        while pos < n:
            lt = text.find("<|", pos)
            end = n if lt < 0 else lt
            if end > pos:
                ids.extend(self._encode_plain(text[pos:end].encode("utf-8")))
                pos = end
                continue
            matched = False
            for s, i in self._special_lookup.items():
                if text.startswith(s, pos):
                    ids.append(i)
                    pos += len(s)
                    matched = True
                    break
            if not matched:
                nxt = text.find("<|", pos + 2)
                stop = n if nxt < 0 else nxt
                ids.extend(self._encode_plain(text[pos:stop].encode("utf-8")))
                pos = stop
        return ids

    def _encode_plain(self, raw: bytes) -> list[int]:
        ids: list[int] = []
        pos = 0
        n = len(raw)
        lookup = self._lookup
        maxlen = self._max_piece
        while pos < n:
            for length in range(min(maxlen, n - pos), 0, -1):
                tid = lookup.get(raw[pos : pos + length])
                if tid is not None:
                    ids.append(tid)
                    pos += length
                    break
        return ids

    def decode(
        self,
        ids: Iterable[int],
        *,
        skip_special_tokens: bool = False,
    ) -> str:
        """Decode to text; invalid UTF-8 becomes U+FFFD as in the byte-level HF decoder.

        vLLM's fast-tokenizer detokenizer does not insert spaces around special tokens, so there
        is no ``spaces_between_special_tokens`` effect here (see ``IncrementalDecoder``).
        """
        table = self.token_bytes
        if skip_special_tokens:
            raw = b"".join(table[i] for i in ids if i >= NUM_SPECIAL)
        else:
            raw = b"".join(table[i] for i in ids)
        return raw.decode("utf-8", errors="replace")

    def token_str(self, token_id: int) -> str:
        """The token's text, as ``tokenizer.decode([id])`` (OpenAI-shaped logprobs)."""
        return self.token_text[token_id]

    def token_piece(self, token_id: int) -> str:
        """The token as ``convert_ids_to_tokens`` shows it: byte-level alphabet (``" "`` is ``"Ġ"``)."""
        if token_id < NUM_SPECIAL:
            return SPECIAL_TOKENS[token_id]
        return "".join(_BYTE_ALPHABET[b] for b in self.token_bytes[token_id])


class IncrementalDecoder:
    """Streaming detokenizer with the tokenizers library's ``DecodeStream`` rule, as vLLM uses it.

    New bytes are decoded together with any held ones; while the result ends in U+FFFD (an
    incomplete or invalid UTF-8 sequence at the end) nothing is emitted. So a character split
    across tokens appears once complete, an invalid byte in the middle shows as U+FFFD, and bytes
    still held when generation ends never appear (vLLM's text for two lone continuation bytes is
    ``""``). The cost per token is one small decode.
    """

    __slots__ = ("_pending", "_skip", "_table", "text")

    _MAX_PENDING = 64  # never hold more than this; emit with replacement characters instead

    def __init__(self, vocab: Vocab, *, skip_special_tokens: bool) -> None:
        self._table = vocab.token_bytes
        self._skip = skip_special_tokens
        self._pending = b""
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token and return the newly emitted text."""
        if self._skip and token_id < NUM_SPECIAL:
            return ""
        raw = self._pending + self._table[token_id]
        delta = raw.decode("utf-8", errors="replace")
        if delta.endswith("\ufffd") and len(raw) < self._MAX_PENDING:
            self._pending = raw
            return ""
        self._pending = b""
        self.text += delta
        return delta


@functools.lru_cache(maxsize=8)
def get_vocab(vocab_size: int) -> Vocab:
    """Shared vocabularies: building one takes milliseconds, and tests create many engines."""
    return Vocab(vocab_size)


def render_chatml(messages: Sequence[tuple[str, str]], *, add_generation_prompt: bool) -> str:
    """The tiny models' ChatML template: ``<|im_start|>{role}\\n{content}<|im_end|>\\n``."""
    parts = [f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)

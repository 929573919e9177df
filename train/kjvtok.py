"""The King James Bible text and a small byte-level BPE tokenizer trained on it.

The text comes from Debian's bible-kjv-text package, printed by its `bible`
program (package bible-kjv). The tokenizer is byte-level BPE in the tiktoken
format: ranks 0..255 are the single bytes, every later rank is a merge learnt
from the training split, and encoding joins, repeatedly, the adjacent pair whose
concatenation has the lowest rank.

Pre-tokenization uses k3's split pattern restricted to ASCII (the text is
checked to be ASCII, where the Unicode classes reduce to these):
\\p{L} = [A-Za-z], \\p{Lu} = [A-Z], \\p{Ll} = [a-z], \\p{N} = [0-9], no Han, no
Lt/Lm/Lo/M characters.
"""
import base64
import heapq
import json
import re
import subprocess

SPLIT = re.compile(
    r"[^\r\nA-Za-z0-9]?[A-Z]*[a-z]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|[^\r\nA-Za-z0-9]?[A-Z]+[a-z]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|[0-9]{1,3}"
    r"| ?[^\sA-Za-z0-9]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+")

# Control tokens after the ranks, in the order of the real tokenizer's first ids
# ([BOS] = ranks, [EOS] = ranks + 1, <|end_of_msg|> = ranks + 2), then the
# chat-format tokens and two reserved ids.
SPECIALS = ["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>",
            "<|reserved_6|>", "<|reserved_7|>"]


def read_bible():
    """[(book, chapter, [verse text, ...]), ...] in canonical order."""
    out = subprocess.run(["bible", "-l100000", "Gen1:1-Rev22:21"], check=True,
                         stdout=subprocess.PIPE, env={"COLUMNS": "100000", "PATH": "/usr/bin:/bin"}).stdout
    text = out.decode("ascii")
    chapters = []
    head = re.compile(r"^(\S.*) (\d+)$")
    verse = re.compile(r"^\s*(\d+) (.*)$")
    for line in text.split("\n"):
        if not line.strip():
            continue
        m = head.match(line)
        if m:
            chapters.append((m.group(1), int(m.group(2)), []))
            continue
        m = verse.match(line)
        if not m or not chapters:
            raise SystemExit("train: error: unexpected line from bible: %r" % line[:80])
        chapters[-1][2].append(m.group(2).strip())
    return chapters, out


def chapter_text(verses):
    return "\n".join(verses) + "\n\n"


def split_text(text):
    return SPLIT.findall(text)


def train_bpe(text, n_ranks):
    """Ranks (list of bytes) learnt by merging the most frequent adjacent pair
    (ties: the smallest pair of rank ids) over the pre-tokenized chunks."""
    counts = {}
    for piece in split_text(text):
        counts[piece] = counts.get(piece, 0) + 1
    words = [[b for b in p.encode("ascii")] for p in sorted(counts)]
    freq = [counts[p] for p in sorted(counts)]
    ranks = [bytes([b]) for b in range(256)]
    index = {r: i for i, r in enumerate(ranks)}
    pair_n = {}
    where = {}
    for wi, w in enumerate(words):
        for a, b in zip(w, w[1:]):
            pair_n[(a, b)] = pair_n.get((a, b), 0) + freq[wi]
            where.setdefault((a, b), set()).add(wi)
    heap = [(-n, p) for p, n in pair_n.items()]
    heapq.heapify(heap)
    while len(ranks) < n_ranks and heap:
        n, p = heapq.heappop(heap)
        if pair_n.get(p, 0) != -n or n == 0:
            continue
        a, b = p
        new = ranks[a] + ranks[b]
        if new in index:
            nid = index[new]
        else:
            nid = len(ranks)
            ranks.append(new)
            index[new] = nid
        changed = {}
        for wi in sorted(where.pop(p, ())):
            w = words[wi]
            f = freq[wi]
            for x, y in zip(w, w[1:]):
                pair_n[(x, y)] -= f
                changed[(x, y)] = 1
            i, o = 0, []
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    o.append(nid)
                    i += 2
                else:
                    o.append(w[i])
                    i += 1
            words[wi] = o
            for x, y in zip(o, o[1:]):
                pair_n[(x, y)] = pair_n.get((x, y), 0) + f
                where.setdefault((x, y), set()).add(wi)
                changed[(x, y)] = 1
        pair_n.pop(p, None)
        for q in sorted(changed):
            if q in pair_n and pair_n[q] > 0:
                heapq.heappush(heap, (-pair_n[q], q))
    return ranks


class Tokenizer:
    def __init__(self, ranks):
        self.ranks = ranks
        self.index = {r: i for i, r in enumerate(ranks)}
        self.cache = {}
        self.n_ranks = len(ranks)
        self.special = {s: self.n_ranks + i for i, s in enumerate(SPECIALS)}
        self.vocab = self.n_ranks + len(SPECIALS)

    def encode_piece(self, piece):
        got = self.cache.get(piece)
        if got is not None:
            return got
        parts = [bytes([b]) for b in piece.encode("ascii")]
        while len(parts) > 1:
            best, bi = None, -1
            for i in range(len(parts) - 1):
                r = self.index.get(parts[i] + parts[i + 1])
                if r is not None and (best is None or r < best):
                    best, bi = r, i
            if best is None:
                break
            parts[bi:bi + 2] = [parts[bi] + parts[bi + 1]]
        ids = [self.index[p] for p in parts]
        self.cache[piece] = ids
        return ids

    def encode(self, text):
        out = []
        for piece in split_text(text):
            out.extend(self.encode_piece(piece))
        return out

    def decode(self, ids):
        return b"".join(self.ranks[i] if i < self.n_ranks else SPECIALS[i - self.n_ranks].encode()
                        for i in ids).decode("utf-8", "replace")

    def write(self, d):
        with open(d + "/tiktoken.model", "w") as f:
            for i, r in enumerate(self.ranks):
                f.write("%s %d\n" % (base64.b64encode(r).decode(), i))
        added = {}
        for i, s in enumerate(SPECIALS):
            added[str(self.n_ranks + i)] = {"content": s, "lstrip": False, "normalized": False,
                                             "rstrip": False, "single_word": False, "special": True}
        cfg = {"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]",
               "pad_token": "[EOS]", "model_max_length": 1048576,
               "tokenizer_class": "TikTokenTokenizer"}
        with open(d + "/tokenizer_config.json", "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")

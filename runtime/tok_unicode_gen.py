#!/usr/bin/python3
# tok_unicode_gen.py - writes k3_unicode_tables.h, the character classes the
# tokenizer's pre-tokenization pattern needs (docs/MODEL.md §5), from the
# Unicode Character Database files of Debian's unicode-data package:
#   UnicodeData.txt  general categories (L*, M*, N*), including First/Last ranges
#   Scripts.txt      Script=Han (the Script property, not Script_Extensions)
#   PropList.txt     White_Space (what the regex engine means by \s)
#   CaseFolding.txt  simple case folding (statuses C and S), for (?i:'s|'t|...)
# and PYSPACE, Python's str.isspace() (general category Zs, or bidirectional
# class WS, B or S), which Kimi's tokenizer wrapper slices long runs by.
# Output: a two-stage table (code point >> 8 -> block, block[cp & 255] -> bits),
# identical blocks shared, and the list of non-ASCII code points that fold to
# one of the contraction letters. Usage: tok_unicode_gen.py UCD_DIR OUT.h
import sys

ucd, out = sys.argv[1], sys.argv[2]
N_CP = 0x110000
LU, LL, LMO, M, NUM, HAN, WS, PYSPACE = 1, 2, 4, 8, 16, 32, 64, 128
bits = bytearray(N_CP)

def ranges(path, want):
    """Yield (lo, hi) for lines 'A..B ; value' or 'A ; value' with value in want."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            cps, val = [x.strip() for x in line.split(";")[:2]]
            if val not in want:
                continue
            if ".." in cps:
                a, b = cps.split("..")
                yield int(a, 16), int(b, 16)
            else:
                yield int(cps, 16), int(cps, 16)

cat_bits = {"Lu": LU, "Lt": LU, "Ll": LL, "Lm": LMO, "Lo": LMO,
            "Mn": M, "Mc": M, "Me": M, "Nd": NUM, "Nl": NUM, "No": NUM}
first = None
n_assigned = 0
with open(ucd + "/UnicodeData.txt", encoding="utf-8") as f:
    for line in f:
        fld = line.rstrip("\n").split(";")
        if len(fld) < 3:
            continue
        cp, name, cat, bidi = int(fld[0], 16), fld[1], fld[2], fld[4]
        b = cat_bits.get(cat, 0)
        if cat == "Zs" or bidi in ("WS", "B", "S"):
            b |= PYSPACE
        if name.endswith(", First>"):
            first = cp
            continue
        lo = first if name.endswith(", Last>") else cp
        first = None
        for c in range(lo, cp + 1):
            bits[c] |= b
            n_assigned += 1
for lo, hi in ranges(ucd + "/Scripts.txt", {"Han"}):
    for c in range(lo, hi + 1):
        bits[c] |= HAN
for lo, hi in ranges(ucd + "/PropList.txt", {"White_Space"}):
    for c in range(lo, hi + 1):
        bits[c] |= WS
if n_assigned < 100000 or not bits[0x4E00] & HAN or not bits[0x20] & WS or not bits[0x1C] & PYSPACE:
    sys.exit("tok_unicode_gen: %s does not look like the Unicode Character Database" % ucd)

letters = "strevmld"
fold = []
with open(ucd + "/CaseFolding.txt", encoding="utf-8") as f:
    for line in f:
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        code, status, mapping = [x.strip() for x in line.split(";")[:3]]
        if status not in ("C", "S"):
            continue
        src, dst = int(code, 16), int(mapping, 16)
        if src >= 0x80 and dst < 0x80 and chr(dst) in letters:
            fold.append((src, chr(dst)))

blocks, index = [], []
seen = {}
for hi in range(N_CP >> 8):
    blk = bytes(bits[hi << 8:(hi + 1) << 8])
    if blk not in seen:
        seen[blk] = len(blocks)
        blocks.append(blk)
    index.append(seen[blk])

o = []
o.append("/* k3_unicode_tables.h - character classes for the tokenizer, written at build")
o.append(" * time by runtime/tok_unicode_gen.py from the Unicode Character Database")
o.append(" * (UnicodeData.txt, Scripts.txt, PropList.txt, CaseFolding.txt). Do not edit. */")
o.append("#ifndef K3_UNICODE_TABLES_H")
o.append("#define K3_UNICODE_TABLES_H")
o.append("#include <stdint.h>")
o.append("#define K3_UC_LU  %d /* Lu or Lt */" % LU)
o.append("#define K3_UC_LL  %d /* Ll */" % LL)
o.append("#define K3_UC_LMO %d /* Lm or Lo */" % LMO)
o.append("#define K3_UC_M   %d /* Mn, Mc, Me */" % M)
o.append("#define K3_UC_N   %d /* Nd, Nl, No */" % NUM)
o.append("#define K3_UC_HAN %d /* Script=Han */" % HAN)
o.append("#define K3_UC_WS  %d /* White_Space */" % WS)
o.append("#define K3_UC_PYSPACE %d /* Python str.isspace(): Zs, or bidi WS, B, S */" % PYSPACE)
o.append("#define K3_UC_NBLOCKS %d" % len(blocks))
o.append("static const uint16_t k3_uc_stage1[%d] = {" % len(index))
for i in range(0, len(index), 16):
    o.append("    " + ", ".join(str(x) for x in index[i:i + 16]) + ",")
o.append("};")
o.append("static const uint8_t k3_uc_stage2[%d] = {" % (len(blocks) * 256))
for blk in blocks:
    for i in range(0, 256, 32):
        o.append("    " + ",".join(str(x) for x in blk[i:i + 32]) + ",")
o.append("};")
o.append("/* non-ASCII code points whose simple case folding is an ASCII letter of")
o.append(" * the contractions ('s 't 're 've 'm 'll 'd) */")
o.append("#define K3_UC_NFOLD %d" % len(fold))
o.append("static const struct { uint32_t cp; char ascii; } k3_uc_fold[%d] = {" % max(1, len(fold)))
for src, dst in fold:
    o.append("    {0x%04X, '%s'}," % (src, dst))
if not fold:
    o.append("    {0, 0},")
o.append("};")
o.append("#endif")
with open(out + ".tmp", "w") as f:
    f.write("\n".join(o) + "\n")
import os
os.replace(out + ".tmp", out)

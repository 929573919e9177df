#!/usr/bin/env node
// parity.js DIR - compares the k3 tokenizer's ids with tiktoken's own.
// DIR holds what the C test wrote: for each NAME in the list below,
// NAME.txt (valid UTF-8 text) and NAME.ids (the C ids, uint32 little-endian).
// The reference is `new Tiktoken(o200k_base ranks, specials, docs/MODEL.md §5 pattern)`;
// "plain" is encoded as ordinary text, "special" with every special allowed.
// "pieces" is encoded with pieces.model, a vocabulary of the 256 bytes and
// every distinct piece k3's pre-tokenizer made: one id per k3 piece comes
// back only if tiktoken splits the text exactly where k3 does.
// Prints one line per file and exits 1 on the first difference (with where).
"use strict";
const fs = require("fs");
const path = require("path");
const { Tiktoken } = require("tiktoken");
const enc = require("tiktoken/encoders/o200k_base.json");

const PATTERN = String.raw`[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`;

const dir = process.argv[2];
const tk = new Tiktoken(enc.bpe_ranks, enc.special_tokens, PATTERN);
const dec = new TextDecoder("utf-8", { fatal: false });
const split = new Tiktoken(fs.readFileSync(path.join(dir, "pieces.model"), "latin1"), {}, PATTERN);
let bad = 0;
for (const [name, allowed, t] of [["plain", null, tk], ["special", "all", tk], ["pieces", null, split]]) {
  const bytes = fs.readFileSync(path.join(dir, name + ".txt"));
  const text = bytes.toString("utf8");
  if (!Buffer.from(text, "utf8").equals(bytes)) {
    console.log(name + ": the text given is not valid UTF-8");
    bad = 1;
    continue;
  }
  const raw = fs.readFileSync(path.join(dir, name + ".ids"));
  const mine = new Uint32Array(raw.buffer, raw.byteOffset, raw.length / 4);
  const ref = allowed ? t.encode(text, allowed) : t.encode_ordinary(text);
  let i = 0;
  while (i < ref.length && i < mine.length && ref[i] === mine[i]) i++;
  if (i === ref.length && i === mine.length) {
    console.log(name + ": " + bytes.length + " bytes, " + ref.length + " ids, identical to tiktoken");
    continue;
  }
  bad = 1;
  const show = (ids) => Array.from(ids.slice(Math.max(0, i - 3), i + 5)).map((id) => {
    try { return id + JSON.stringify(dec.decode(t.decode_single_token_bytes(id))); } catch (e) { return id + "?"; }
  }).join(" ");
  console.log(name + ": first difference at id " + i + " (tiktoken " + ref.length + " ids, k3 " + mine.length + ")");
  console.log("  tiktoken: " + show(ref));
  console.log("  k3:       " + show(mine));
}
tk.free();
split.free();
process.exit(bad);

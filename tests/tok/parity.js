#!/usr/bin/env node
// parity.js DIR - compares the k3 tokenizer's ids with tiktoken's own.
// DIR holds what the C test wrote: for each NAME in the list below,
// NAME.txt (valid UTF-8 text) and NAME.ids (the C ids, uint32 little-endian).
// The reference is `new Tiktoken(o200k_base ranks, specials, SPEC §5 pattern)`;
// "plain" is encoded as ordinary text, "special" with every special allowed.
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
let bad = 0;
for (const [name, allowed] of [["plain", null], ["special", "all"]]) {
  const bytes = fs.readFileSync(path.join(dir, name + ".txt"));
  const text = bytes.toString("utf8");
  if (!Buffer.from(text, "utf8").equals(bytes)) {
    console.log(name + ": the text given is not valid UTF-8");
    bad = 1;
    continue;
  }
  const raw = fs.readFileSync(path.join(dir, name + ".ids"));
  const mine = new Uint32Array(raw.buffer, raw.byteOffset, raw.length / 4);
  const ref = allowed ? tk.encode(text, allowed) : tk.encode_ordinary(text);
  let i = 0;
  while (i < ref.length && i < mine.length && ref[i] === mine[i]) i++;
  if (i === ref.length && i === mine.length) {
    console.log(name + ": " + bytes.length + " bytes, " + ref.length + " ids, identical to tiktoken");
    continue;
  }
  bad = 1;
  const show = (ids) => Array.from(ids.slice(Math.max(0, i - 3), i + 5)).map((t) => {
    try { return t + JSON.stringify(dec.decode(tk.decode_single_token_bytes(t))); } catch (e) { return t + "?"; }
  }).join(" ");
  console.log(name + ": first difference at id " + i + " (tiktoken " + ref.length + " ids, k3 " + mine.length + ")");
  console.log("  tiktoken: " + show(ref));
  console.log("  k3:       " + show(mine));
}
tk.free();
process.exit(bad);

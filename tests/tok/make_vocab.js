#!/usr/bin/env node
// make_vocab.js DIR - writes DIR/tiktoken.model and DIR/tokenizer_config.json
// from the o200k_base vocabulary that the npm tiktoken package ships. Its
// bpe_ranks string is lines of "! FIRST_RANK b64 b64 ..." (consecutive ranks
// from FIRST_RANK) or "b64 RANK"; we write the plain one-token-per-line form.
"use strict";
const fs = require("fs");
const path = require("path");
const dir = process.argv[2];
if (!dir) {
  console.error("usage: make_vocab.js DIR");
  process.exit(2);
}
const enc = require("tiktoken/encoders/o200k_base.json");
const lines = [];
for (const line of enc.bpe_ranks.split("\n")) {
  if (!line) continue;
  const f = line.split(" ");
  if (f[0] === "!") {
    const first = Number(f[1]);
    for (let i = 2; i < f.length; i++) lines.push(f[i] + " " + (first + i - 2));
  } else {
    lines.push(f[0] + " " + f[1]);
  }
}
lines.forEach((l, i) => {
  if (Number(l.split(" ")[1]) !== i) throw new Error("o200k_base ranks are not 0..n-1 in order at " + i);
});
fs.writeFileSync(path.join(dir, "tiktoken.model"), lines.join("\n") + "\n");
const added = {};
for (const [content, id] of Object.entries(enc.special_tokens))
  added[String(id)] = { content, lstrip: false, normalized: false, rstrip: false, single_word: false, special: true };
fs.writeFileSync(path.join(dir, "tokenizer_config.json"), JSON.stringify({
  added_tokens_decoder: added,
  bos_token: null,
  eos_token: { content: "<|endoftext|>", special: true },
}, null, 2) + "\n");
console.log(lines.length + " ranks, " + Object.keys(added).length + " specials");

#!/usr/bin/env node
// gen_corpus.js OUT [BYTES] - writes the tokenizer parity corpus: a fixed-seed
// mix of English, code, JSON, Chinese/Japanese/Korean, emoji with ZWJ
// joiners, accents and combining marks, long whitespace runs, CRLF, digits of
// many scripts and invalid UTF-8. Same bytes on every run and machine.
// Only characters assigned by Unicode 15.0 are used, so the regex engine
// inside tiktoken and Debian's unicode-data agree on every class.
"use strict";
const fs = require("fs");

const out = process.argv[2];
const target = Number(process.argv[3] || 1200000);
if (!out || !(target > 0)) {
  console.error("usage: gen_corpus.js OUT [BYTES]");
  process.exit(2);
}

let seed = 0x9e3779b9;
function rnd() { // mulberry32
  seed = (seed + 0x6d2b79f5) >>> 0;
  let t = seed;
  t = Math.imul(t ^ (t >>> 15), t | 1);
  t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
}
const ri = (n) => Math.floor(rnd() * n);
const pick = (a) => a[ri(a.length)];
const cp = (lo, hi) => String.fromCodePoint(lo + ri(hi - lo + 1));
const rep = (n, f) => { let s = ""; for (let i = 0; i < n; i++) s += f(i); return s; };

const words = ("the of and to in is was for on that with as by at from his her it an were are which this " +
  "be or has had not but they their one all been also more its new after first two other into who over " +
  "model token stream buffer expert layer weight memory budget checkpoint shard header offset tensor " +
  "quick brown fox jumps lazy dog naïve café résumé coöperate façade Straße Ærø smörgåsbord").split(" ");
const contractions = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'M", "'LL",
  "'D", "'ſ", "'x", "'", "''", "'rE", "'lL", "'dd"];
function english() {
  let s = "";
  const n = 5 + ri(25);
  for (let i = 0; i < n; i++) {
    let w = pick(words);
    const r = rnd();
    if (r < 0.1) w = w[0].toUpperCase() + w.slice(1);
    else if (r < 0.14) w = w.toUpperCase();
    else if (r < 0.18) w = w + pick(contractions);
    else if (r < 0.2) w = pick(["camelCase", "HTTPServer", "getHTTPResponseCode", "iPhone", "McDonald",
      "ǅemal", "ǈubljana", "ʰello", "ªb", "xʼy", "DON'T", "I'M", "Can't", "we'Ll", "HE'ſ", "O'Neil"]);
    else if (r < 0.25) w = String(ri(10 ** (1 + ri(9))));
    else if (r < 0.27) w = (rnd() * 1000).toFixed(ri(6));
    s += (i ? pick([" ", " ", " ", "  ", ", ", "; ", " - ", " (", ") "]) : "") + w;
  }
  return s + pick([". ", "! ", "? ", ".\n", ".\r\n", "...\n\n", ":\n"]);
}

const code = [
  "int main(int argc, char **argv)\n{\n    if (argc < 2) {\n        return 2;\n    }\n\tfor (int i = 0; i < n; i++)\n\t\tsum += a[i] * b[i];\n}\n",
  "def f(x, *args, **kw):\n    '''doc'''\n    return [y ** 2 for y in range(x) if y % 3 == 0]  # comment\n\n\n",
  "const re = /[a-z]+\\d{2,}/gi;\r\nfunction g(a,b){return a===b?a<<2:b>>>1;}\r\n",
  "    let v: Vec<u32> = xs.iter().map(|x| x + 1).collect();\n        // TODO(k3): fix\n",
  "#include <stdio.h>\n#define MAX(a,b) ((a)>(b)?(a):(b))\n/* block\n * comment */\n",
  "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%o%';\n",
  "<div class=\"x\">&nbsp;&amp;<br/></div>\n<!-- <|endoftext|> -->\n",
  "x+=1;y-=2;z*=3;w/=4;p%=5;q&=6;r|=7;s^=8;t<<=9;u>>=10;v=!w&&x||y;\n",
  "if __name__ == \"__main__\":\n\tmain()\n\n\n\n",
  "    }\n  }\n}\n\n",
];
function codeSeg() {
  let s = pick(code);
  if (rnd() < 0.3) s = s.replace(/ {4}/g, rep(1 + ri(12), () => " "));
  return s;
}

function jstring() {
  return pick([pick(words), "a\\\"b\\\\c\\n", "\\u00e9\\ud83d\\ude00", "中文", "💡 idea", "", "x y  z"]);
}
function json(depth) {
  const r = rnd();
  if (depth > 3 || r < 0.3) {
    return pick([String(ri(100000)), String(-ri(100)), (rnd() * 1e6).toExponential(3), "true", "false", "null",
      "\"" + jstring() + "\""]);
  }
  const ind = rep(depth + 1, () => "  ");
  if (r < 0.6) {
    const n = 1 + ri(4);
    return "[" + rep(n, (i) => (i ? ", " : "") + json(depth + 1)) + "]";
  }
  const n = 1 + ri(5);
  return "{\n" + rep(n, (i) => (i ? ",\n" : "") + ind + "\"" + pick(words) + "_" + i + "\": " + json(depth + 1)) +
    "\n" + rep(depth, () => "  ") + "}";
}

const cjkPunct = ["。", "，", "、", "「", "」", "！", "？", "：", "（", "）", "…", "〇", "々", "〆", "ー", "・", "　", "《", "》"];
function chinese(long) {
  const n = long ? 150 + ri(300) : 2 + ri(40);
  let s = "";
  for (let i = 0; i < n; i++) {
    const r = rnd();
    if (r < 0.85) s += cp(0x4e00, 0x9fa5);
    else if (r < 0.92 && !long) s += pick(cjkPunct);
    else if (r < 0.95 && !long) s += String(ri(2025));
    else if (!long) s += pick([" ", "A", "abc", "GPU"]);
    else s += cp(0x4e00, 0x9fa5);
  }
  return s;
}
function japanese() {
  let s = "";
  const n = 5 + ri(40);
  for (let i = 0; i < n; i++) {
    const r = rnd();
    if (r < 0.4) s += cp(0x3041, 0x3096);
    else if (r < 0.65) s += cp(0x30a1, 0x30fa);
    else if (r < 0.85) s += cp(0x4e00, 0x9fa5);
    else s += pick(cjkPunct);
  }
  return s;
}
function korean() {
  return rep(2 + ri(10), () => rep(1 + ri(5), () => cp(0xac00, 0xd7a3)) + pick([" ", " ", ". ", ", ", "\n"])) +
    pick(["각", "ㄱㄴㄷ", ""]);
}

const emoji = ["👨‍👩‍👧‍👦", "🏳️‍🌈", "👍🏽", "🇫🇷🇯🇵", "1️⃣", "#️⃣", "❤️", "🧑🏿‍💻", "👩‍❤️‍💋‍👨", "😀😃😄", "🙂", "✌🏻",
  "🐻‍❄️", "\u200d", "\u200d\u200d", "a\u200db", "\ufe0f", "👁️‍🗨️", "🫠"];
function emojiSeg() {
  return rep(1 + ri(8), () => pick(emoji) + pick(["", "", " ", "!", "\n", "x"]));
}

const accents = ["e\u0301", "a\u0308\u0304", "n\u0303", "\u0301start", "\u0300\u0301\u0302", "Tiếng Việt",
  "Ελληνικά λέξη", "Русский ТЕКСТ ёжик", "العربية مرحبا", "עברית שלום", "हिन्दी भाषा", "ภาษาไทย",
  "Z\u0351\u036b\u0343\u036a\u0302a\u0357l\u0310g\u0351o", "ǅ", "ﬁ", "Å", "Å", "İstanbul", "ß", "ẞ", "Ǆ",
  "x\u20dd", "\u0903", "ا\u064b", "क\u093f", "\u1dc0", "a\u0345"];
function accentSeg() {
  return rep(1 + ri(10), () => pick(accents) + pick([" ", "", ", ", "\n", "'s", "'LL"]));
}

const spaces = [" ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2028", "\u2029", "\u000b", "\u000c",
  "\u0085", "\u2009", "\u200b", "\u1680", "\u202f"];
function wsSeg() {
  const r = rnd();
  if (r < 0.3) return rep(1 + ri(300), () => " ") + pick(["x", "", "\n", ".", "\u00e9"]);
  if (r < 0.5) return rep(1 + ri(20), () => pick(spaces)) + pick(["a", "1", "!", "", "中"]);
  if (r < 0.7) return rep(1 + ri(10), () => "\r\n") + rep(ri(8), () => " ") + "y";
  return pick(["a \n b", "a  \n\n  b", " \r\n\r\n  bar", "x   ", "\t\t\n", "  \r  \n  ", " !!\r\n\r\n",
    " ??? \n", "\n\n\n", " \u00a0 x", "foo \r\nbar", "\r\r\r", ". \n"]);
}

const digits = ["٣٤٥", "１２３４", "²³", "½¾", "ⅫⅣ", "〇一二", "𝟙𝟚𝟛", "①②", "१२३", "12345678901234567890",
  "3.14159", "1,000,000", "0x1F", "1e-9", "৪৫"];
function numberSeg() {
  return rep(1 + ri(6), () => pick(digits) + pick(["", " ", "a", "%", "\n"]));
}

function invalid() {
  const seqs = [[0x80], [0xbf], [0xff], [0xfe], [0xc0, 0xaf], [0xc1, 0xbf], [0xe0, 0x80, 0x80], [0xed, 0xa0, 0x80],
    [0xed, 0xbf, 0xbf], [0xf5, 0x80, 0x80, 0x80], [0xf4, 0x90, 0x80, 0x80], [0xe2, 0x82], [0xf0, 0x9f, 0x98],
    [0xc3], [0xe4, 0xb8], [0xf8, 0x88, 0x80, 0x80, 0x80], [0xc3, 0x28], [0xe2, 0x28, 0xa1]];
  const parts = [];
  const n = 1 + ri(4);
  for (let i = 0; i < n; i++) {
    parts.push(Buffer.from(pick(["", "abc", " ", "word", "中", "\n", "'s", "1", "é"]), "utf8"));
    parts.push(Buffer.from(pick(seqs)));
  }
  parts.push(Buffer.from(pick(["", "xyz", " ", "\r\n"]), "utf8"));
  return Buffer.concat(parts);
}

function longRuns() {
  return pick([
    () => rep(500 + ri(1500), () => pick(["a", "b", "c", "d", "e"])),
    () => rep(200 + ri(800), () => pick(["=", "-", "*", "#", "~"])),
    () => rep(100 + ri(400), () => String(ri(10))),
    () => rep(50 + ri(300), () => pick(["ab", "ba", "aa"])) + pick(["'s", "'LL", ""]),
    () => chinese(true),
    () => rep(300, () => "\u00e9"),
    () => rep(200, () => cp(0x0400, 0x04ff)),
  ])();
}

const gens = [[english, 30], [codeSeg, 12], [() => json(0) + "\n", 8], [() => chinese(false), 10], [japanese, 6],
  [korean, 5], [emojiSeg, 5], [accentSeg, 6], [wsSeg, 8], [numberSeg, 4], [invalid, 4], [longRuns, 1],
  [() => "\u0000" + pick(words) + "\ufffd", 1]];
const total = gens.reduce((a, g) => a + g[1], 0);
const bufs = [];
let size = 0;
while (size < target) {
  let r = ri(total), g = 0;
  while (r >= gens[g][1]) r -= gens[g++][1];
  const v = gens[g][0]();
  const b = Buffer.isBuffer(v) ? v : Buffer.from(v, "utf8");
  bufs.push(b);
  size += b.length;
}
fs.writeFileSync(out, Buffer.concat(bufs));

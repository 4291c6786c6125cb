// Held-out Node.js text processing heap: batch tokenizing and word-frequency maps over
// generated text, results kept. Prints READY, then waits for EOF on stdin.
//   node node_text.js --mb 80 --seed 7
const args = process.argv.slice(2);
const opt = (k, d) => { const i = args.indexOf(k); return i >= 0 ? Number(args[i + 1]) : d; };
const MB = opt('--mb', 80), SEED = opt('--seed', 7);
let s = SEED >>> 0;
const rnd = () => { s = (s * 1664525 + 1013904223) >>> 0; return s / 4294967296; };
const SYL = ['ka', 'lo', 'mer', 'tion', 'da', 'ta', 'pro', 'ess', 'ing', 'ver', 'al', 'con', 'fig', 'ser', 'vi', 're', 'quest', 'lo', 'ad', 'in', 'dex'];
const vocab = [];
for (let i = 0; i < 6000; i++) { let w = ''; const n = 1 + Math.floor(rnd() * 4); for (let j = 0; j < n; j++) w += SYL[Math.floor(rnd() * SYL.length)]; vocab.push(w); }
const word = () => vocab[Math.floor(vocab.length * Math.pow(rnd(), 2.5))];
const docs = [], freqs = [], tokens = [];
let used = 0;
while (used < MB * 1048576) {
  const parts = [];
  for (let k = 0; k < 400; k++) parts.push(word() + (rnd() < 0.1 ? '.' : rnd() < 0.05 ? ',' : ''));
  const text = parts.join(' ');
  const toks = text.toLowerCase().split(/[^a-z]+/).filter(Boolean);
  const f = new Map();
  for (const t of toks) f.set(t, (f.get(t) || 0) + 1);
  const top = [...f.entries()].sort((a, b) => b[1] - a[1]).slice(0, 20);
  docs.push(text); tokens.push(Int32Array.from(toks.map(t => t.length))); freqs.push({ top, size: f.size, map: f });
  used += text.length * 2 + toks.length * 40 + f.size * 60;
}
process.stdout.write('READY\n');
process.stdin.on('data', () => {});
process.stdin.on('end', () => { console.error(docs.length, freqs.length, tokens.length); process.exit(0); });

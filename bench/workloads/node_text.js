#!/usr/bin/env node
// Workload D: Node.js batch text processing, deterministic from a seed.
//
// What a Node agent tool process keeps after crunching a corpus: generated documents
// (sentences over a Zipf vocabulary, numbers, identifiers, URLs), tokenized in batches;
// per document its token array, word-frequency Map, top words and a sparse TF-IDF vector
// (Int32Array ids + Float32Array weights); per batch a bigram Map; globally the term and
// document frequencies. Everything is kept. It grows until the live heap reaches --mb.
//
// Speaks the READY / CHECK / TOUCH / VERIFY protocol of bench/workloads/protocol.py:
//   stdout READY <rss>; stdin CHECK -> CHECK ok|FAIL <sum> <sum_s> <touch_s> <pages>;
//   stdin TOUCH -> VERIFY ok <sum> <sum_s> <touch_s> <pages> (exit 0) | VERIFY FAIL <got> <want> (exit 1);
//   EOF before TOUCH: exit 2.
//   With --agent-loop (bench/density.py): a digest per document at build time, and
//   stdin ROUND <seed> <ws_fraction> <transient_mib> -> ROUND ok <act_s> <items> <bytes> |
//   ROUND FAIL <item> <got> <want>: verify a skewed choice of documents (mostly the newest,
//   protocol.py skewed_picks), then tokenize ~transient_mib MiB of their text again (freed).
// TOUCH reads every page this process holds in RAM or swap (pagemap + /proc/self/mem, as
// bench/workloads/pagewalk.py does), then recomputes the checksum over all kept data.
//
//   node bench/workloads/node_text.js --mb 300 --seed 1
'use strict';
const fs = require('fs');
const crypto = require('crypto');
const readline = require('readline');

const PAGE = 4096;
const BASE_BYTES = 70 << 20; // node itself before any data (RSS): code, builtins, snapshot, young generation

function parseArgs(argv) {
  const opt = { mb: 300, seed: 1, corrupt: false, agentLoop: false };
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === '--mb') opt.mb = Number(argv[++i]);
    else if (argv[i] === '--seed') opt.seed = Number(argv[++i]);
    else if (argv[i] === '--corrupt-for-test') opt.corrupt = true;
    else if (argv[i] === '--agent-loop') opt.agentLoop = true;
    else { process.stderr.write(`node_text: unknown argument ${argv[i]}\n`); process.exit(64); }
  }
  return opt;
}

// xorshift32: small, fast, same sequence on every platform
function rng(seed) {
  let s = (seed * 2654435761) >>> 0 || 1;
  const next = () => { s ^= s << 13; s >>>= 0; s ^= s >>> 17; s ^= s << 5; s >>>= 0; return s / 4294967296; };
  return { next, int: (n) => Math.floor(next() * n), pick: (a) => a[Math.floor(next() * a.length)] };
}

const SYLLABLES = ['an', 'ber', 'cal', 'dor', 'en', 'fi', 'gra', 'hol', 'in', 'jur', 'ka', 'lin',
  'mo', 'nex', 'or', 'pra', 'qui', 'ros', 'sta', 'tor', 'un', 'vel', 'wen', 'xi', 'yor', 'zu'];
const FUNCTION_WORDS = ('the of and to a in is that for it as was with be by on not he this are or ' +
  'his from at which but have an they you were her she there been one all we their has would').split(' ');

function makeVocab(r) {
  const words = new Set(FUNCTION_WORDS);
  while (words.size < 12000) {
    let w = '';
    const n = 1 + r.int(4);
    for (let i = 0; i < n; i++) w += r.pick(SYLLABLES);
    words.add(w);
  }
  const vocab = [...words];
  const cum = new Float64Array(vocab.length); // Zipf(1.1) cumulative weights
  let acc = 0;
  for (let i = 0; i < vocab.length; i++) { acc += 1 / Math.pow(i + 1, 1.1); cum[i] = acc; }
  return { vocab, cum, total: acc };
}

function zipfWord(r, v) {
  const x = r.next() * v.total;
  let lo = 0, hi = v.cum.length - 1;
  while (lo < hi) { const mid = (lo + hi) >> 1; if (v.cum[mid] < x) lo = mid + 1; else hi = mid; }
  return v.vocab[lo];
}

function sentence(r, v) {
  const n = 6 + r.int(20);
  const out = [];
  for (let i = 0; i < n; i++) {
    const k = r.next();
    if (k < 0.03) out.push(String(r.int(100000)));
    else if (k < 0.04) out.push(`${zipfWord(r, v)}${zipfWord(r, v).replace(/^./, (c) => c.toUpperCase())}()`);
    else if (k < 0.045) out.push(`https://${zipfWord(r, v)}.example.org/${zipfWord(r, v)}/${r.int(1000)}`);
    else out.push(zipfWord(r, v));
  }
  out[0] = out[0].charAt(0).toUpperCase() + out[0].slice(1);
  return out.join(' ') + r.pick(['.', '.', '.', '?', '!', ';']);
}

const TOKEN = /[A-Za-z][A-Za-z0-9_']*|\d+(?:\.\d+)?|[^\sA-Za-z0-9]/g;

function processBatch(r, v, state, batchNo) {
  const docs = [];
  const bigrams = new Map();
  for (let d = 0; d < 100; d++) {
    const paras = [];
    const np = 2 + r.int(6);
    for (let p = 0; p < np; p++) {
      const ns = 3 + r.int(8);
      const ss = [];
      for (let s = 0; s < ns; s++) ss.push(sentence(r, v));
      paras.push(ss.join(' '));
    }
    const text = paras.join('\n\n');
    const tokens = (text.match(TOKEN) || []).map((t) => t.toLowerCase());
    const freq = new Map();
    for (let i = 0; i < tokens.length; i++) {
      const t = tokens[i];
      freq.set(t, (freq.get(t) || 0) + 1);
      if (i > 0) { const b = tokens[i - 1] + ' ' + t; bigrams.set(b, (bigrams.get(b) || 0) + 1); }
    }
    for (const [t, c] of freq) {
      state.tf.set(t, (state.tf.get(t) || 0) + c);
      state.df.set(t, (state.df.get(t) || 0) + 1);
      if (!state.ids.has(t)) state.ids.set(t, state.ids.size);
    }
    const ndocs = state.docs.length + docs.length + 1;
    const ids = new Int32Array(freq.size);
    const weights = new Float32Array(freq.size);
    let j = 0;
    for (const [t, c] of freq) {
      ids[j] = state.ids.get(t);
      weights[j] = (c / tokens.length) * Math.log(ndocs / state.df.get(t));
      j++;
    }
    const top = [...freq].sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : 1)).slice(0, 25);
    docs.push({ id: `doc-${batchNo}-${d}`, title: sentence(r, v).slice(0, 60), text, tokens, freq, top,
      ids, weights, chars: text.length });
  }
  state.docs.push(...docs);
  state.bigrams.push(bigrams);
}

function build(opt) {
  const r = rng(opt.seed);
  const v = makeVocab(r);
  const state = { docs: [], bigrams: [], tf: new Map(), df: new Map(), ids: new Map(), vocab: v.vocab };
  const target = opt.mb * 1048576;
  let batch = 0;
  for (;;) {
    processBatch(r, v, state, batch++);
    const m = process.memoryUsage();
    if (m.heapUsed + m.arrayBuffers + BASE_BYTES >= target) break;
  }
  return state;
}

function checksum(state) {
  const h = crypto.createHash('sha256');
  const SEP = '\u0001';
  for (const d of state.docs) {
    h.update(d.id + SEP + d.title + SEP + d.chars + SEP + d.text + SEP);
    h.update(d.tokens.join(SEP));
    for (const [t, c] of d.freq) h.update(t + SEP + c + SEP);
    h.update(JSON.stringify(d.top));
    h.update(Buffer.from(d.ids.buffer, d.ids.byteOffset, d.ids.byteLength));
    h.update(Buffer.from(d.weights.buffer, d.weights.byteOffset, d.weights.byteLength));
  }
  for (const m of [...state.bigrams, state.tf, state.df, state.ids]) {
    for (const [k, c] of m) h.update(k + SEP + c + SEP);
  }
  h.update(state.vocab.join(SEP));
  return h.digest('hex').slice(0, 32);
}

function docDigest(d) {
  const h = crypto.createHash('sha256');
  const SEP = '\u0001';
  h.update(d.id + SEP + d.title + SEP + d.chars + SEP + d.text + SEP);
  h.update(d.tokens.join(SEP));
  for (const [t, c] of d.freq) h.update(t + SEP + c + SEP);
  h.update(JSON.stringify(d.top));
  h.update(Buffer.from(d.ids.buffer, d.ids.byteOffset, d.ids.byteLength));
  h.update(Buffer.from(d.weights.buffer, d.weights.byteOffset, d.weights.byteLength));
  return h.digest('hex').slice(0, 32);
}

// protocol.py skewed_picks: k distinct docs, each one of the newest fifth with p 0.8, else any
function skewedPicks(r, n, k) {
  k = Math.max(1, Math.min(n, k));
  const recent = Math.max(1, Math.floor(n * 0.2));
  const seen = new Set();
  const out = [];
  while (out.length < k) {
    const i = r.next() < 0.8 ? n - 1 - r.int(recent) : r.int(n);
    if (!seen.has(i)) { seen.add(i); out.push(i); }
  }
  return out;
}

function act(state, digests, seed, frac, mib) {
  const r = rng(seed);
  const picks = skewedPicks(r, state.docs.length, Math.round(frac * state.docs.length));
  let bytes = 0;
  for (const i of picks) {
    const got = docDigest(state.docs[i]);
    if (got !== digests[i]) return [`doc${i}`, got, digests[i]];
    bytes += state.docs[i].chars * 2 + state.docs[i].ids.byteLength * 2;
  }
  // transient: the tool's working copy of the picked text, re-tokenized and counted
  const want = mib * 1048576;
  const parts = [];
  let size = 0;
  while (size < want) {
    for (const i of picks) {
      parts.push(state.docs[i].text);
      size += state.docs[i].text.length;
      if (size >= want) break;
    }
  }
  const big = parts.join('\n');
  const freq = new Map();
  let ntok = 0;
  const re = new RegExp(TOKEN.source, 'g');
  for (let m = re.exec(big); m !== null; m = re.exec(big)) { freq.set(m[0], (freq.get(m[0]) || 0) + 1); ntok++; }
  if (ntok === 0) return ['tokens', '0', '>0'];
  return [null, picks.length, bytes];
}

// Read every page this process holds in RAM or in swap: private mappings, pages whose
// pagemap entry says "swapped" (bit 62), or "present" (bit 63) and not a file page (bit 61).
function touchPages() {
  const t0 = process.hrtime.bigint();
  const maps = fs.readFileSync('/proc/self/maps', 'utf8').split('\n');
  const pm = fs.openSync('/proc/self/pagemap', 'r');
  const mem = fs.openSync('/proc/self/mem', 'r');
  const CHUNK = 65536; // pagemap entries per read
  const pmBuf = Buffer.allocUnsafe(CHUNK * 8);
  const RUN = 256; // pages per mem read
  const memBuf = Buffer.allocUnsafe(RUN * PAGE);
  let pages = 0;
  const readRun = (addr, n) => {
    try { pages += Math.floor(fs.readSync(mem, memBuf, 0, n * PAGE, addr) / PAGE); } catch (e) { /* unmapped */ }
  };
  try {
    for (const line of maps) {
      const parts = line.split(/\s+/);
      if (parts.length < 5) continue;
      const perms = parts[1];
      const name = parts[5] || '';
      if (perms[0] !== 'r' || perms[3] !== 'p' || /^\[(vvar|vvar_vclock|vdso|vsyscall|uprobes)\]$/.test(name)) continue;
      const [a, b] = parts[0].split('-');
      const lo = parseInt(a, 16), hi = parseInt(b, 16);
      const n = (hi - lo) / PAGE;
      for (let off = 0; off < n; off += CHUNK) {
        const k = Math.min(CHUNK, n - off);
        let got;
        try { got = fs.readSync(pm, pmBuf, 0, k * 8, (lo / PAGE + off) * 8) / 8; } catch (e) { break; }
        let runStart = -1, runLen = 0;
        for (let i = 0; i < got; i++) {
          const high = pmBuf.readUInt32LE(i * 8 + 4);
          const want = (high & 0x40000000) !== 0 || ((high & 0x80000000) !== 0 && (high & 0x20000000) === 0);
          if (want && runLen > 0 && runLen < RUN && runStart + runLen === off + i) { runLen++; continue; }
          if (runLen > 0) readRun(lo + runStart * PAGE, runLen);
          runLen = 0;
          if (want) { runStart = off + i; runLen = 1; }
        }
        if (runLen > 0) readRun(lo + runStart * PAGE, runLen);
      }
    }
  } finally {
    fs.closeSync(pm);
    fs.closeSync(mem);
  }
  return [pages, Number(process.hrtime.bigint() - t0) / 1e9];
}

function main() {
  const opt = parseArgs(process.argv.slice(2));
  const t0 = Date.now();
  const state = build(opt);
  const want = checksum(state);
  const digests = opt.agentLoop ? state.docs.map(docDigest) : null;
  const m = process.memoryUsage();
  process.stderr.write(`node_text: ${state.docs.length} docs, ${state.tf.size} terms, ` +
    `heap ${m.heapUsed >> 20} MiB, rss ${m.rss >> 20} MiB, built in ${((Date.now() - t0) / 1000).toFixed(1)}s, ` +
    `checksum ${want}\n`);
  process.stdout.write(`READY ${process.memoryUsage().rss}\n`);
  let done = false;
  const rl = readline.createInterface({ input: process.stdin, terminal: false });
  rl.on('line', (line) => {
    const cmd = line.trim();
    if (done) return;
    if (cmd.startsWith('ROUND')) {
      if (!digests) { process.stdout.write('ROUND FAIL - unsupported (start the workload with --agent-loop)\n'); return; }
      const [seed, frac, mib] = cmd.split(/\s+/).slice(1).map(Number);
      const t = process.hrtime.bigint();
      const res = act(state, digests, seed, frac, mib);
      const dt = Number(process.hrtime.bigint() - t) / 1e9;
      if (res[0] === null) process.stdout.write(`ROUND ok ${dt.toFixed(4)} ${res[1]} ${res[2]}\n`);
      else process.stdout.write(`ROUND FAIL ${res[0]} ${res[1]} ${res[2]}\n`);
      return;
    }
    if (cmd !== 'CHECK' && cmd !== 'TOUCH') {
      if (cmd) process.stderr.write(`node_text: unknown command ${JSON.stringify(cmd)}\n`);
      return;
    }
    if (opt.corrupt && cmd === 'TOUCH') state.docs[state.docs.length >> 1].weights[0] += 1;
    const [pages, touchS] = touchPages();
    const t = process.hrtime.bigint();
    const got = checksum(state);
    const sumS = (Number(process.hrtime.bigint() - t) / 1e9).toFixed(3);
    const ok = got === want;
    if (cmd === 'CHECK') {
      process.stdout.write(`CHECK ${ok ? 'ok' : 'FAIL'} ${got} ${sumS} ${touchS.toFixed(4)} ${pages}\n`);
      return;
    }
    done = true;
    if (ok) process.stdout.write(`VERIFY ok ${got} ${sumS} ${touchS.toFixed(4)} ${pages}\n`, () => process.exit(0));
    else process.stdout.write(`VERIFY FAIL ${got} ${want}\n`, () => process.exit(1));
  });
  rl.on('close', () => {
    if (done) return;
    process.stderr.write('node_text: stdin closed before TOUCH\n');
    process.exit(2);
  });
}

main();

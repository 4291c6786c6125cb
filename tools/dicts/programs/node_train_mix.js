// Training-only Node.js heap (never used for held-out pages): objects of several shapes,
// JSON strings and their parsed trees, class instances, typed arrays, template strings.
// Prints READY, then waits for EOF on stdin.
const args = process.argv.slice(2);
const opt = (k, d) => { const i = args.indexOf(k); return i >= 0 ? Number(args[i + 1]) : d; };
const MB = opt('--mb', 60), SEED = opt('--seed', 1);
let s = SEED >>> 0;
const rnd = () => { s = (s * 22695477 + 1) >>> 0; return s / 4294967296; };
const W = 'request response handler session token user account project issue status build deploy queue worker retry timeout latency cache index search result document page model prompt message role content tool'.split(' ');
const pick = () => W[Math.floor(rnd() * W.length)];
class Span { constructor(i) { this.id = i; this.name = pick() + '.' + pick(); this.start = Date.now() + i; this.dur = rnd() * 100; this.tags = { svc: pick(), ok: rnd() < 0.9 }; } }
const keep = [];
let used = 0;
let i = 0;
while (used < MB * 1048576) {
  const o = { id: 'msg_' + Math.floor(rnd() * 1e12).toString(36), role: pick(), content: Array.from({ length: 5 + Math.floor(rnd() * 40) }, pick).join(' '), n: i, score: rnd() };
  const js = JSON.stringify(o);
  keep.push(js, JSON.parse(js), new Span(i), `${pick()}:${i}:${o.id}`);
  if (i % 50 === 0) keep.push(Float64Array.from({ length: 256 }, rnd));
  used += js.length * 2 + 400;
  i++;
}
process.stdout.write('READY\n');
process.stdin.on('data', () => {});
process.stdin.on('end', () => { console.error(keep.length); process.exit(0); });

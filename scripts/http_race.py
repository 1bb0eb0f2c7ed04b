"""Interleaved plain vs default-drafter (and llama-server) timing over HTTP, per prompt set.
Usage: http_race.py SPECDECK_URL OUT.json [limit] [max_tokens] [LLAMA_SERVER_URL]"""
import json, sys, time, statistics
import httpx
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from app.bench.prompts import load_prompts

url, out = sys.argv[1], sys.argv[2]
limit = int(sys.argv[3]) if len(sys.argv) > 3 else 3
max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 128
sets = {"chat": load_prompts("mt-bench", limit=1)[:limit],
        "code": load_prompts("humaneval", limit=limit),
        "math": load_prompts("spec-bench:math_reasoning", limit=limit)}
for cat in ("mt_bench", "translation", "summarization", "qa", "rag"):
    sets[f"spec-bench:{cat}"] = load_prompts(f"spec-bench:{cat}", limit=max(1, limit - 1))
client = httpx.Client(timeout=600)

llama = sys.argv[5] if len(sys.argv) > 5 else None  # llama-server's /v1 URL

def flush(base):
    # a short other prompt between timed requests: no request reuses the last one's prompt
    # cache (the prompt's prefill is part of what a user waits for)
    client.post(f"{base}/chat/completions", json={"messages": [{"role": "user", "content":
                "Name a colour."}], "max_tokens": 1, "temperature": 0}).raise_for_status()

def ask(text, drafter, base=None):
    base = base or url
    flush(base)
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0}
    if drafter:
        body["drafter"] = drafter
    t = time.perf_counter()
    r = client.post(f"{base}/chat/completions", json=body)
    wall = time.perf_counter() - t
    r.raise_for_status()
    data = r.json()
    return wall, data["usage"]["completion_tokens"], data["choices"][0]["message"]["content"], data.get("speculative")

for _ in range(600):
    try:
        client.get(f"{url}/models").raise_for_status(); break
    except httpx.HTTPError:
        time.sleep(1)
ask("Say hi.", "none"); ask("Say hi.", None)  # warm both paths
if llama:
    ask("Say hi.", None, llama)
rows, flip = [], False
for name, prompts in sets.items():
    for p in prompts:
        order = [("plain", "none", None), ("default", None, None)]
        if llama:
            order.append(("llama", None, llama))
        if flip: order.reverse()
        flip = not flip
        got = {}
        for label, d, base in order:
            got[label] = ask(p.text, d, base)
        (pw, pn, pt, _), (dw, dn, dt, ds) = got["plain"], got["default"]
        row = dict(set=name, id=p.id, plain_tok_s=pn / pw, default_tok_s=dn / dw,
                   ratio=(dn / dw) / (pn / pw), same=pt == dt, tokens=dn,
                   spec={k: v for k, v in (ds or {}).items() if k in ("draft_acceptance_rate", "num_draft_tokens", "prefill_s", "draft_s", "verify_s")})
        if llama:
            lw, ln, lt, _ = got["llama"]
            row.update(llama_tok_s=ln / lw, vs_llama=(dn / dw) / (ln / lw),
                       plain_vs_llama=(pn / pw) / (ln / lw))
        rows.append(row)
        print(f"{name:24s} {p.id:>8s} plain {pn/pw:6.2f} default {dn/dw:6.2f} tok/s  {row['ratio']:.2f}x same={pt==dt}"
              + (f" llama {row['llama_tok_s']:6.2f} default/llama {row['vs_llama']:.2f}x" if llama else "")
              + f" {json.dumps(row['spec'])}", flush=True)
summary = {}
for name in sets:
    r = [x["ratio"] for x in rows if x["set"] == name]
    summary[name] = statistics.median(r)
    extra = ""
    if llama:
        v = [x["vs_llama"] for x in rows if x["set"] == name]
        q = [x["plain_vs_llama"] for x in rows if x["set"] == name]
        summary[name + " vs llama"] = statistics.median(v)
        extra = f"  default/llama.cpp {statistics.median(v):.2f}x  plain/llama.cpp {statistics.median(q):.2f}x"
    print(f"MEDIAN {name:24s} default/plain {summary[name]:.2f}x{extra}  (n={len(r)})")
json.dump({"rows": rows, "summary": summary}, open(out, "w"), indent=1)

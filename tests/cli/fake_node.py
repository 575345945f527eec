# DEV ONLY: a stand-in for swarm-node until it lands. Deleted before hand-off.
import argparse, hashlib, json, math, random, signal, sys, time
p = argparse.ArgumentParser()
p.add_argument("--initial-peers", action="append"); p.add_argument("--metrics-file"); p.add_argument("--max-outer-steps", type=int)
p.add_argument("--inner-steps", type=int); p.add_argument("--fail", action="store_true")
args, _ = p.parse_known_args()
pid = "12D3KooW" + hashlib.sha256(str(random.random()).encode()).hexdigest()[:40]
f = open(args.metrics_file, "a")
def emit(**kw):
    f.write(json.dumps({"time": time.time(), "peer_id": pid, **kw}) + "\n"); f.flush()
def term(*a):
    emit(event="exit", outer_step=-1, reason="SIGTERM"); sys.exit(0)
signal.signal(signal.SIGTERM, term)
time.sleep(1)
emit(event="start", maddrs=[], run_id="x", outer_step=0, parameters=1)
for n in range(args.max_outer_steps):
    for i in range(args.inner_steps):
        time.sleep(0.05)
        if i % 5 == 0: emit(event="progress", outer_step=n, inner_step=i, inner_steps=args.inner_steps, train_loss=5 - n * 0.3)
    emit(event="outer_step", outer_step=n, train_loss=5 - n * 0.3, eval_loss=5.1 - n * 0.3,
         state_sha256=hashlib.sha256(str(n).encode()).hexdigest(), group_size=3, bytes_sent=100, bytes_received=100,
         inner_s=1.0, wall_s=1.2, tokens=100 * n, tokens_per_s=1234.5)
emit(event="exit", outer_step=args.max_outer_steps - 1, reason="max outer steps")

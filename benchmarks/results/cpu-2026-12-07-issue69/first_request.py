"""Start `jaxserve serve` (default model) as a user would, wait for ready, then time the README
curl 10 times. Usage: python first.py [extra serve args]"""
import json, subprocess, sys, time, os, signal
import httpx
port = 8123
cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port), *sys.argv[1:]]
env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
log = open("/tmp/s69_server.log", "w")
p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
t0 = time.time()
while True:
    try:
        if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
            break
    except Exception:
        pass
    if p.poll() is not None:
        print("server died"); print(open("/tmp/s69_server.log").read()[-3000:]); sys.exit(1)
    time.sleep(0.2)
print(f"ready after {time.time()-t0:.1f} s", flush=True)
body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0}
times = []
with httpx.Client(timeout=120) as c:
    for i in range(10):
        t = time.perf_counter()
        r = c.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
        times.append(time.perf_counter() - t)
        u = r.json()["usage"]
        print(i + 1, f"{times[-1]:.3f} s", u["completion_tokens"], flush=True)
print("first/tenth", round(times[0] / times[9], 2), "first/median(2..10)", round(times[0] / sorted(times[1:])[4], 2))
p.send_signal(signal.SIGINT); p.wait(30)

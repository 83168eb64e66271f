#!/usr/bin/env python3
"""Checks `gdsllm serve`'s WebSocket JSON-RPC (/v1/ws) and gRPC (--grpc-port) transports with
the standard Python clients, `websockets` and `grpcio`, on a real model.

Starts `gdsllm serve --port 0 --grpc-port 0 --api-key KEY`, then:
- WebSocket: auth failures (wrong header: 401 before the upgrade; none: -32001 until `auth`),
  greedy `generate` and `chat` give REST's text, `embed` gives REST's vectors, `cancel` ends a
  running generation, a client that disconnects mid-stream frees its sequence, 200 concurrent
  streams complete;
- gRPC (stubs generated from server/proto by grpcio-tools): auth failures, the KServe v2
  health/metadata RPCs, ModelInfer gives REST's embeddings, Generate streams REST's greedy
  tokens (and the WebSocket's token ids), a passed deadline and a cancelled call free their
  sequence, 200 concurrent streams complete.
Stops the server with SIGTERM and expects a clean exit. Exits non-zero on the first failure.

Every wait has a timeout (a reply, a stream, a metric to change), and a watchdog ends the whole
run after --timeout seconds, so that a regression fails with the step that stalled instead of
hanging CI.

If the clients are not importable, the script creates a virtual environment (--venv, default
a temporary directory), pip-installs them and re-runs itself there.

Usage: scripts/rpc_client_check.py --gdsllm target/release/gdsllm --model DIR
"""

import argparse
import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request

from venv_rerun import ensure_importable

KEY = "rpc-check-key"
PACKAGES = ["websockets==17.4", "grpcio==1.85.3", "grpcio-tools==1.85.1"]
PROTO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "server", "proto")
CONCURRENT = 200
# Greedy requests compared between transports.
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]
# A greedy completion that goes on for hundreds of tokens, for the cancel and disconnect cases
# (SmolLM2's greedy answer to an instruction given as a bare completion prompt is often an
# immediate end of sequence: no token to wait for, nothing left to cancel).
LONG = "Count from 1 to 500: 1, 2, 3,"
# Seconds: one reply or streamed message; a whole generation of a few tokens (or the 200
# concurrent ones); a sequence to be freed.
REPLY_TIMEOUT = 60
STREAMS_TIMEOUT = 300
FREED_TIMEOUT = 30


class Watchdog(Exception):
    """The whole run took longer than --timeout."""


def on_alarm(signum, frame):
    stack = "".join(traceback.format_stack(frame))
    raise Watchdog(f"the checks did not finish in time; they were at:\n{stack}")


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def start_server(args):
    cmd = [args.gdsllm, "serve", "-m", args.model, "--port", "0", "--grpc-port", "0",
           "-c", "512", "--max-batch", "32", "--api-key", KEY]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSLLM_") or k == "GDSLLM_HOME"}
    # The log goes to a file: hundreds of requests would fill a pipe nobody reads.
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    proc.log = log
    base = proc.stdout.readline().strip()
    grpc_line = proc.stdout.readline().strip()
    if not base.startswith("http://") or not grpc_line.startswith("grpc://"):
        proc.kill()
        sys.exit(f"gdsllm serve did not print its addresses: {base!r} {grpc_line!r}\n"
                 f"{read_log(proc)}")
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(base + "/health") as r:
                if r.status == 200:
                    break
        except Exception:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            sys.exit(f"the server did not become ready:\n{read_log(proc)}")
        time.sleep(0.2)
    return proc, base, grpc_line[len("grpc://"):]


def read_log(proc):
    proc.log.seek(0)
    return proc.log.read()


def rest(base, path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json",
                                          "authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=REPLY_TIMEOUT) as r:
        return json.loads(r.read())


def metric(base, name):
    with urllib.request.urlopen(base + "/metrics", timeout=REPLY_TIMEOUT) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_freed(base, cancelled_before, what):
    """The sequence was cancelled and nothing runs any more (FREED_TIMEOUT at most)."""
    deadline = time.time() + FREED_TIMEOUT
    cancelled = running = None
    while time.time() < deadline:
        cancelled = metric(base, "gdsllm_requests_cancelled_total")
        running = metric(base, "gdsllm_requests_running")
        if cancelled >= cancelled_before + 1 and running == 0:
            print(f"ok: {what}: cancelled {cancelled_before:.0f} -> {cancelled:.0f}, running 0")
            return
        time.sleep(0.05)
    raise AssertionError(f"{what}: the sequence was not freed "
                         f"(cancelled {cancelled}, running {running})")


def max_abs_diff(a, b):
    check(len(a) == len(b), f"lengths differ: {len(a)} vs {len(b)}")
    return max(abs(x - y) for x, y in zip(a, b))


# ---- WebSocket -------------------------------------------------------------------------

async def ws_call(ws, rid, method, params):
    await ws.send(json.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": params}))


async def ws_recv(ws, waiting_for):
    """The next message, or an AssertionError naming what was awaited after REPLY_TIMEOUT."""
    try:
        return json.loads(await asyncio.wait_for(ws.recv(), REPLY_TIMEOUT))
    except asyncio.TimeoutError:
        raise AssertionError(f"no message in {REPLY_TIMEOUT} s while waiting for {waiting_for}")


async def ws_answer(ws, rid, others=None):
    """The token notifications of call `rid` and its answer. Answers to other calls are kept
    in `others` (by id) when given."""
    tokens = []
    while True:
        m = await ws_recv(ws, f"the answer to call {rid}")
        if m.get("method") == "token" and m["params"]["request"] == rid:
            tokens.append(m["params"])
        elif m.get("id") == rid:
            return tokens, m
        elif others is not None and "id" in m:
            others[m["id"]] = m


async def websocket_checks(base, reference):
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    url = base.replace("http://", "ws://") + "/v1/ws"
    try:
        async with connect(url, additional_headers={"authorization": "Bearer wrong"}):
            raise AssertionError("a wrong key was accepted")
    except InvalidStatus as e:
        check(e.response.status_code == 401, f"wrong key: HTTP {e.response.status_code}")
    print("ok: ws wrong key refused with 401 before the upgrade")

    async with connect(url) as ws:
        await ws_call(ws, 1, "generate", {"prompt": PROMPT})
        _, m = await ws_answer(ws, 1)
        check(m.get("error", {}).get("code") == -32001, f"no key: {m}")
        await ws_call(ws, 2, "auth", {"key": "wrong"})
        _, m = await ws_answer(ws, 2)
        check(m.get("error", {}).get("code") == -32001, f"wrong auth: {m}")
        await ws_call(ws, 3, "auth", {"key": KEY})
        _, m = await ws_answer(ws, 3)
        check(m["result"]["authenticated"] is True, f"auth: {m}")
        print("ok: ws -32001 without a key, `auth` with the right one")

        await ws_call(ws, 4, "generate", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0})
        tokens, m = await ws_answer(ws, 4)
        text = m["result"]["text"]
        check(text == reference["completion"], f"ws generate {text!r} != REST {reference['completion']!r}")
        check("".join(t["text"] for t in tokens) == text, "notifications do not add up to the text")
        check([t["token_id"] for t in tokens] == m["result"]["token_ids"], "token ids")
        reference["ws_token_ids"] = m["result"]["token_ids"]
        print(f"ok: ws generate = REST greedy ({len(tokens)} tokens as notifications): {text!r}")

        await ws_call(ws, 5, "chat", {"messages": CHAT, "max_tokens": 16, "temperature": 0})
        _, m = await ws_answer(ws, 5)
        check(m["result"]["text"] == reference["chat"], f"ws chat {m} != REST {reference['chat']!r}")
        print("ok: ws chat = REST greedy chat")

        await ws_call(ws, 6, "embed", {"input": ["hello world", "a cat"]})
        _, m = await ws_answer(ws, 6)
        diff = max(max_abs_diff(d["embedding"], r) for d, r in zip(m["result"]["data"], reference["embeddings"]))
        print(f"ok: ws embed = REST embeddings, max abs diff {diff:.2e} (tolerance 1e-6)")
        check(diff <= 1e-6, "ws embed differs from REST")
        await ws_call(ws, 7, "embed", {"input": "hello world", "dimensions": 64, "quantize": "int8"})
        _, m = await ws_answer(ws, 7)
        d = m["result"]["data"][0]
        check(len(d["embedding"]) == 64 and max(abs(q) for q in d["embedding"]) == 127, f"int8: {d}")
        print("ok: ws embed dimensions=64 quantize=int8")

        cancelled = metric(base, "gdsllm_requests_cancelled_total")
        await ws_call(ws, 8, "generate", {"prompt": LONG, "max_tokens": 400, "temperature": 0})
        while True:
            m = await ws_recv(ws, "the first token of call 8")
            check(m.get("id") != 8, f"call 8 ended before its first token: {m}")
            if m.get("method") == "token":
                break
        await ws_call(ws, 9, "cancel", {"id": 8})
        others = {}
        _, done = await ws_answer(ws, 8, others)
        check("result" in done, f"cancelled generate: {done}")
        check(done["result"]["finish_reason"] == "cancelled", f"cancel: {done}")
        check(done["result"]["usage"]["completion_tokens"] < 400, f"cancel: {done}")
        answer = others.get(9) or (await ws_answer(ws, 9))[1]
        check(answer.get("result") == {"cancelled": True}, f"cancel answer: {answer}")
        print(f"ok: ws cancel answered and the generate ended after "
              f"{done['result']['usage']['completion_tokens']} tokens")
        await asyncio.to_thread(wait_freed, base, cancelled, "ws cancel")

    cancelled = metric(base, "gdsllm_requests_cancelled_total")
    ws = await connect(url, additional_headers={"authorization": f"Bearer {KEY}"})
    await ws_call(ws, 1, "generate", {"prompt": LONG, "max_tokens": 400, "temperature": 0})
    while (await ws_recv(ws, "the first token")).get("method") != "token":
        pass
    ws.transport.abort()  # gone without a closing handshake
    # In a thread: the event loop must run for the aborted socket to be closed at all.
    await asyncio.to_thread(wait_freed, base, cancelled, "ws client disconnected mid-stream")

    async def one(i):
        async with connect(url, additional_headers={"authorization": f"Bearer {KEY}"}) as ws:
            await ws_call(ws, i, "generate", {"prompt": f"Count to {i}:", "max_tokens": 3, "temperature": 0})
            tokens, m = await ws_answer(ws, i)
            check("result" in m, f"stream {i}: {m}")
            check("".join(t["text"] for t in tokens) == m["result"]["text"], f"stream {i}")

    started = time.time()
    try:
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(CONCURRENT))), STREAMS_TIMEOUT)
    except asyncio.TimeoutError:
        raise AssertionError(f"{CONCURRENT} ws streams did not complete in {STREAMS_TIMEOUT} s")
    print(f"ok: {CONCURRENT} concurrent ws streams completed ({time.time() - started:.1f} s)")


# ---- gRPC ------------------------------------------------------------------------------

def grpc_stubs(out):
    """Generates the Python stubs of server/proto into the directory `out` and imports them."""
    from grpc_tools import protoc

    protos = ["grpc_predict_v2.proto", "gdsllm.proto"]
    code = protoc.main(["protoc", f"-I{PROTO_DIR}", f"--python_out={out}",
                        f"--grpc_python_out={out}", *[os.path.join(PROTO_DIR, p) for p in protos]])
    check(code == 0, f"grpc_tools.protoc failed ({code})")
    sys.path.insert(0, out)
    import gdsllm_pb2
    import gdsllm_pb2_grpc
    import grpc_predict_v2_pb2
    import grpc_predict_v2_pb2_grpc
    return grpc_predict_v2_pb2, grpc_predict_v2_pb2_grpc, gdsllm_pb2, gdsllm_pb2_grpc


def grpc_checks(base, address, reference, model_id, stubs_dir):
    import grpc

    pb, pb_grpc, gen, gen_grpc = grpc_stubs(stubs_dir)
    channel = grpc.insecure_channel(address)
    kserve = pb_grpc.GRPCInferenceServiceStub(channel)
    generation = gen_grpc.GenerationStub(channel)
    auth = [("authorization", f"Bearer {KEY}")]

    for md, what in [(None, "no key"), ([("authorization", "Bearer wrong")], "wrong key")]:
        try:
            kserve.ServerLive(pb.ServerLiveRequest(), metadata=md, timeout=REPLY_TIMEOUT)
            raise AssertionError(f"gRPC accepted {what}")
        except grpc.RpcError as e:
            check(e.code() == grpc.StatusCode.UNAUTHENTICATED, f"{what}: {e.code()}")
    print("ok: grpc UNAUTHENTICATED without a key and with a wrong one")

    check(kserve.ServerLive(pb.ServerLiveRequest(), metadata=auth, timeout=REPLY_TIMEOUT).live, "ServerLive")
    check(kserve.ServerReady(pb.ServerReadyRequest(), metadata=auth, timeout=REPLY_TIMEOUT).ready, "ServerReady")
    check(kserve.ModelReady(pb.ModelReadyRequest(name=model_id), metadata=auth, timeout=REPLY_TIMEOUT).ready, "ModelReady")
    check(not kserve.ModelReady(pb.ModelReadyRequest(name="nope"), metadata=auth, timeout=REPLY_TIMEOUT).ready, "ModelReady nope")
    meta = kserve.ServerMetadata(pb.ServerMetadataRequest(), metadata=auth, timeout=REPLY_TIMEOUT)
    check(meta.name == "gdsllm", f"ServerMetadata {meta}")
    mm = kserve.ModelMetadata(pb.ModelMetadataRequest(name=model_id), metadata=auth, timeout=REPLY_TIMEOUT)
    check(mm.inputs[0].name == "text" and mm.outputs[0].datatype == "FP32", f"ModelMetadata {mm}")
    print("ok: grpc ServerLive/ServerReady/ModelReady/ServerMetadata/ModelMetadata")

    texts = [b"hello world", b"a cat"]
    infer = pb.ModelInferRequest(model_name=model_id, inputs=[pb.ModelInferRequest.InferInputTensor(
        name="text", datatype="BYTES", shape=[len(texts)],
        contents=pb.InferTensorContents(bytes_contents=texts))])
    out = kserve.ModelInfer(infer, metadata=auth, timeout=REPLY_TIMEOUT).outputs[0]
    n, dim = out.shape
    flat = list(out.contents.fp32_contents)
    diff = max(max_abs_diff(flat[i * dim:(i + 1) * dim], reference["embeddings"][i]) for i in range(n))
    print(f"ok: grpc ModelInfer = REST embeddings, shape {list(out.shape)}, max abs diff {diff:.2e} (tolerance 1e-6)")
    check(diff <= 1e-6, "ModelInfer differs from REST")

    req = gen.GenerateRequest(prompt=PROMPT, max_tokens=16, temperature=0.0)
    text, ids, done = "", [], None
    for msg in generation.Generate(req, metadata=auth, timeout=REPLY_TIMEOUT):
        if msg.HasField("token"):
            text += msg.token.text
            ids.append(msg.token.id)
        else:
            done = msg.done
    text += done.text
    check(text == reference["completion"], f"grpc Generate {text!r} != REST {reference['completion']!r}")
    check(ids == reference["ws_token_ids"], f"grpc token ids {ids} != ws {reference['ws_token_ids']}")
    check(done.usage.completion_tokens == len(ids), f"usage {done.usage}")
    print(f"ok: grpc Generate = REST greedy text and the ws token ids ({len(ids)} tokens)")

    chat = gen.GenerateRequest(messages=[gen.ChatMessage(**m) for m in CHAT], max_tokens=16, temperature=0.0)
    parts = [m.token.text if m.HasField("token") else m.done.text for m in generation.Generate(chat, metadata=auth, timeout=REPLY_TIMEOUT)]
    check("".join(parts) == reference["chat"], f"grpc chat {''.join(parts)!r}")
    print("ok: grpc Generate with messages = REST greedy chat")

    try:
        list(generation.Generate(gen.GenerateRequest(prompt=PROMPT, max_tokens=4, top_p=7.0), metadata=auth,
                                 timeout=REPLY_TIMEOUT))
        raise AssertionError("top_p=7 was accepted")
    except grpc.RpcError as e:
        check(e.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in e.details(), f"{e.code()} {e.details()}")
    print("ok: grpc INVALID_ARGUMENT naming the field")

    cancelled = metric(base, "gdsllm_requests_cancelled_total")
    call = generation.Generate(gen.GenerateRequest(prompt=LONG, max_tokens=400, temperature=0.0),
                               metadata=auth, timeout=1.0)
    try:
        for _ in call:
            pass
        raise AssertionError("a 1 s deadline did not end a 400-token generation")
    except grpc.RpcError as e:
        check(e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline: {e.code()}")
    wait_freed(base, cancelled, "grpc deadline exceeded")

    cancelled = metric(base, "gdsllm_requests_cancelled_total")
    call = generation.Generate(gen.GenerateRequest(prompt=LONG, max_tokens=400, temperature=0.0),
                               metadata=auth, timeout=REPLY_TIMEOUT)
    next(call)
    call.cancel()
    wait_freed(base, cancelled, "grpc call cancelled by the client")

    def one(i):
        parts = []
        request = gen.GenerateRequest(prompt=f"Count to {i}:", max_tokens=3, temperature=0.0)
        for m in generation.Generate(request, metadata=auth, timeout=STREAMS_TIMEOUT):
            parts.append(m.done.finish_reason if m.HasField("done") else "")
        check(parts and parts[-1] in ("stop", "length"), f"stream {i}: {parts}")

    started = time.time()
    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        list(pool.map(one, range(CONCURRENT)))
    print(f"ok: {CONCURRENT} concurrent grpc streams completed ({time.time() - started:.1f} s)")
    channel.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gdsllm", required=True)
    parser.add_argument("--model", default=os.environ.get("GDSLLM_TEST_MODEL"))
    parser.add_argument("--venv")
    parser.add_argument("--timeout", type=int, default=900,
                        help="seconds the whole run may take before it fails (default 900)")
    args = parser.parse_args()
    if not args.model:
        sys.exit("--model (or GDSLLM_TEST_MODEL) is required")
    ensure_importable(["websockets", "grpc", "grpc_tools"], PACKAGES, args.venv)
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(args.timeout)
    proc, base, grpc_address = start_server(args)
    try:
        reference = {
            "completion": rest(base, "/v1/completions",
                               {"prompt": PROMPT, "max_tokens": 16, "temperature": 0})["choices"][0]["text"],
            "chat": rest(base, "/v1/chat/completions",
                         {"messages": CHAT, "max_tokens": 16, "temperature": 0})["choices"][0]["message"]["content"],
            "embeddings": [d["embedding"] for d in rest(base, "/v1/embeddings",
                                                         {"input": ["hello world", "a cat"]})["data"]],
        }
        model_id = rest(base, "/v1/completions", {"prompt": "x", "max_tokens": 1})["model"]
        asyncio.run(websocket_checks(base, reference))
        with tempfile.TemporaryDirectory(prefix="gdsllm-rpc-stubs-") as stubs_dir:
            grpc_checks(base, grpc_address, reference, model_id, stubs_dir)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "killed after 60 s"
    check(code == 0, f"gdsllm serve exited with {code}:\n{read_log(proc)[-4000:]}")
    print("all rpc client checks passed")


if __name__ == "__main__":
    main()

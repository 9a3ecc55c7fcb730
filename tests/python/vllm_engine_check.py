"""By hand, where vLLM's engine runs (a GPU machine, or a CPU build of vLLM): the same prompts
through vLLM's engine (vllm.LLM) with its default loader and with `--load-format tensorferry`,
greedy, in two fresh processes; the generated tokens and their log-probabilities must be equal.

    python tests/python/vllm_engine_check.py MODEL [--tp N] [--extra '{"cooperative": true}']
        [--engine-arg key=value ...]

MODEL: a local directory or a hub name with safetensors weights. tensorferry must be importable
(with its dist-info: vLLM finds the plugin through the `vllm.general_plugins` entry point).
Exit status 0 when the outputs agree. docs/models.md ("vLLM") records where it ran."""
import argparse
import json
import os
import subprocess
import sys

PROMPTS = [[1, 2, 3, 4], [9, 8, 7], [5] * 12]


def generate(model, load_format, extra, tp, engine_args):
    from vllm import LLM, SamplingParams
    kwargs = dict(model=model, load_format=load_format, tensor_parallel_size=tp,
                  skip_tokenizer_init=True, enforce_eager=True, max_model_len=256)
    if extra:
        kwargs["model_loader_extra_config"] = extra
    kwargs.update(engine_args)
    llm = LLM(**kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(max_tokens=16, temperature=0.0, logprobs=1))
    finally:
        llm.llm_engine.engine_core.shutdown()  # the engine core and worker processes
    return [{"tokens": list(o.outputs[0].token_ids),
             "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                         o.outputs[0].token_ids)]}
            for o in outs]


def _value(text):
    try:
        return json.loads(text)
    except ValueError:
        return text


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--extra", default="{}", help="model_loader_extra_config for tensorferry (JSON)")
    p.add_argument("--engine-arg", action="append", default=[],
                   help="key=value passed to vllm.LLM (value as JSON when it parses)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    engine_args = {k: _value(v) for k, v in (a.split("=", 1) for a in args.engine_arg)}
    if args.child:
        fmt = args.child
        extra = json.loads(args.extra) if fmt == "tensorferry" else None
        print("RESULT " + json.dumps(generate(args.model, fmt, extra, args.tp, engine_args)),
              flush=True)
        return 0
    results = {}
    for fmt in ("safetensors", "tensorferry"):
        cmd = [sys.executable, os.path.abspath(__file__), args.model, "--tp", str(args.tp),
               "--extra", args.extra, "--child", fmt]
        for a in args.engine_arg:
            cmd += ["--engine-arg", a]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            sys.stderr.write(r.stdout[-4000:] + r.stderr[-8000:])
            print(f"{fmt}: the engine gave no result (exit {r.returncode})")
            return 1
        results[fmt] = json.loads(lines[-1][len("RESULT "):])
        for line in (r.stdout + r.stderr).splitlines():
            if "tensorferry: " in line and " tensors, " in line:
                print(line.strip())
    if results["safetensors"] != results["tensorferry"]:
        print("DIFFERENT outputs:\n" + json.dumps(results, indent=1))
        return 1
    print(f"same outputs for {len(PROMPTS)} prompts (tp {args.tp}, extra {args.extra})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

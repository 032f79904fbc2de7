"""Generate text from a trained checkpoint with the serving engine (`models.serving`).

    python -m experiments.generate --checkpoint runs/quickstart --prompt "def "
    python -m experiments.generate --checkpoint runs/quickstart --interactive
    python -m experiments.generate --checkpoint runs/quickstart --requests in.jsonl --out out.jsonl

--prompt streams the continuation to stdout as it is produced. --interactive reads one prompt a
line from stdin and streams each continuation (end with Ctrl-D). --requests runs every line of a
JSONL file as one request, all of them batched together (continuous batching), and writes one
JSONL result a request, in the file's order, to --out (default: stdout):

    in:   {"prompt": "def ", "max_tokens": 64, "temperature": 0.8, "top_p": 0.95, "seed": 1,
           "stop": ["\\n"], "id": "a"}             (only "prompt" is required; or "prompt_tokens")
    out:  {"id": "a", "prompt": "def ", "text": "...", "tokens": [...], "logprobs": [...],
           "finish_reason": "stop" | "length"}

The flags --max-tokens, --temperature, --top-k, --top-p, --seed and --stop are the defaults of
every request. Text is bytes (`train.tokenizer`): a prompt starts with the BOS token, and a stop
string is a single byte, e.g. "\\n". Log-probabilities are those of the distribution each token
was drawn from (`models.serving.sample_rows`).

Errors (a missing or damaged checkpoint, a prompt longer than --max-seq-len allows, an invalid
sampling value, a bad JSONL line) print one line, `error: ...`, naming the argument, and exit with
status 2; `--debug` shows the traceback.
"""

import argparse
import codecs
import json
import math
import sys
from collections.abc import Callable

from models.generate import Sampling
from models.serving import Completion, Engine, Request
from train.checkpoint import CheckpointError
from train.cli import one_line_errors
from train.inference import load_model
from train.tokenizer import NUM_BYTES, decode, encode

# Request fields of a --requests line, and the flags that give their defaults.
FIELDS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_k": "--top-k",
          "top_p": "--top-p", "seed": "--seed", "stop": "--stop"}


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m experiments.generate",
                                     description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, metavar="RUN_DIR",
                        help="a training run's folder (its checkpoints/ are read), e.g. "
                        "runs/quickstart")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prompt", help="generate from this text, streaming the tokens")
    mode.add_argument("--interactive", action="store_true",
                      help="read prompts from stdin, one a line")
    mode.add_argument("--requests", metavar="FILE.jsonl", help="run a JSONL file of requests")
    parser.add_argument("--out", metavar="FILE.jsonl",
                        help="with --requests: where the results go (default: stdout)")
    parser.add_argument("--max-tokens", type=int, default=200, help="tokens per request at most")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 picks the argmax")
    parser.add_argument("--top-k", type=int, help="keep the k most likely tokens")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus mass (1: all)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed, in [0, 2^32)")
    parser.add_argument("--stop", action="append", default=[], metavar="BYTE",
                        help='stop after this byte, e.g. "\\n" (repeatable)')
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="parameter dtype for inference (default: bfloat16)")
    parser.add_argument("--slots", type=int, default=8, help="sequences decoded together")
    parser.add_argument("--max-seq-len", type=int, default=2048,
                        help="tokens a sequence holds, prompt and generated together")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per MLA cache page")
    parser.add_argument("--num-pages", type=int,
                        help="MLA cache pages (default: enough for every slot at --max-seq-len)")
    parser.add_argument("--prefill-chunk", type=int, default=256,
                        help="longest prefill chunk: --page-size times a power of two")
    parser.add_argument("--prefix-sharing", action="store_true",
                        help="requests with a common prompt prefix share its cache pages")
    parser.add_argument("--debug", action="store_true",
                        help="on an error, show the full traceback instead of one line")
    args = parser.parse_args(argv)
    if args.out and not args.requests:
        parser.error("--out goes with --requests")
    return args


def stop_tokens(stops, where: str) -> tuple[int, ...]:
    """The token ids of stop strings, each one byte (`where` names the argument in errors)."""
    tokens = []
    for stop in stops:
        ids = encode(stop, bos=False) if isinstance(stop, str) else None
        if ids is None or len(ids) != 1:
            raise ValueError(f"{where} must be single bytes such as \"\\n\" (this model's tokens "
                             f"are bytes), got {stop!r}")
        tokens.append(int(ids[0]))
    return tuple(tokens)


def make_request(fields: dict, prompt, named: Callable[[str], str]) -> Request:
    """A Request from `fields` (those of FIELDS, JSON values); `named(field)` is how an error
    names a field (a flag, or a JSONL line's field)."""
    try:
        sampling = Sampling(temperature=fields["temperature"], top_k=fields["top_k"],
                            top_p=fields["top_p"])
    except (ValueError, TypeError) as error:
        field = next((name for name in ("top_k", "top_p") if name in str(error)), "temperature")
        raise ValueError(f"{named(field)}: {error}") from None
    stops = fields["stop"]
    if not isinstance(stops, list):
        raise ValueError(f"{named('stop')} must be a list of single-byte strings, got {stops!r}")
    stops = stop_tokens(stops, named("stop"))
    for name in ("max_tokens", "seed"):
        value = fields[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{named(name)} must be an int, got {value!r}")
    try:
        return Request(prompt, sampling, seed=fields["seed"], max_tokens=fields["max_tokens"],
                       stop_tokens=stops)
    except ValueError as error:
        field = next((name for name in ("seed", "max_tokens") if str(error).startswith(name)),
                     "prompt")
        raise ValueError(f"{named(field)}: {error}") from None


def flag_defaults(args) -> dict:
    return {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_k": args.top_k,
            "top_p": args.top_p, "seed": args.seed, "stop": list(args.stop)}


def read_requests(path: str, defaults: dict) -> list[tuple[object, Request, str | None, str]]:
    """(id, Request, prompt text or None, where in the file) of each line of the JSONL file at
    `path`."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--requests {path}: {error}") from None
    requests = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--requests {path} line {number}: "
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}not JSON ({error})") from None
        if not isinstance(item, dict) or ("prompt" in item) == ("prompt_tokens" in item):
            raise ValueError(f"{where}expected an object with \"prompt\" (text) or "
                             "\"prompt_tokens\" (ids)")
        unknown = set(item) - set(FIELDS) - {"prompt", "prompt_tokens", "id"}
        if unknown:
            raise ValueError(f"{where}unknown field(s) {sorted(unknown)}; known: "
                             f"{sorted(FIELDS) + ['id', 'prompt', 'prompt_tokens']}")
        if "prompt" in item and not isinstance(item["prompt"], str):
            raise ValueError(f"{where}prompt must be a string, got {item['prompt']!r}")
        text = item.get("prompt")
        prompt = encode(text) if text is not None else item["prompt_tokens"]
        fields = {**defaults, **{k: v for k, v in item.items() if k in FIELDS}}
        request = make_request(fields, prompt, lambda field: f"{where}{field}")
        requests.append((item.get("id", number), request, text, where))
    return requests


def load_engine(args) -> Engine:
    """The checkpoint's model in an engine sized by the flags (errors name the flag)."""
    try:
        model, _ = load_model(args.checkpoint, step=args.step, dtype=args.dtype)
    except (FileNotFoundError, CheckpointError) as error:
        raise ValueError(f"--checkpoint {args.checkpoint}: {error}") from None
    num_pages = args.num_pages or 1 + args.slots * math.ceil(args.max_seq_len / args.page_size)
    try:
        return Engine(model, slots=args.slots, num_pages=num_pages, page_size=args.page_size,
                      max_seq_len=args.max_seq_len, prefill_chunk_tokens=args.prefill_chunk,
                      prefix_sharing=args.prefix_sharing)
    except ValueError as error:
        flag = next((flag for name, flag in [("prefill_chunk_tokens", "--prefill-chunk"),
                                             ("page_size", "--page-size"), ("slots", "--slots"),
                                             ("max_seq_len", "--max-seq-len"),
                                             ("num_pages", "--num-pages")]
                     if str(error).startswith(name)), "--slots")
        raise ValueError(f"{flag}: {error}") from None


def submit(engine: Engine, request: Request, where: str) -> int:
    """`engine.submit(request)`; a refusal names `where` the request came from."""
    try:
        return engine.submit(request)
    except ValueError as error:
        raise ValueError(f"{where}{error}") from None


def stream_one(engine: Engine, request: Request, write: Callable[[str], None]) -> Completion:
    """Runs `request` alone, writing its text as tokens come (UTF-8 decoded incrementally)."""
    request_id = submit(engine, request, "--prompt: ")
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for event in engine.stream():
        token = event.token
        write(text.decode(bytes([token])) if token < NUM_BYTES else text.decode(b"", final=True)
              + decode([token]))
    write(text.decode(b"", final=True))
    return engine.completion(request_id)


def result_line(request_id, text: str | None, done: Completion) -> dict:
    return {"id": request_id, "prompt": text, "text": decode(done.tokens),
            "tokens": list(done.tokens), "logprobs": [round(p, 6) for p in done.logprobs],
            "finish_reason": done.finish_reason}


def main(argv=None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    with one_line_errors(args.debug):
        defaults = flag_defaults(args)
        if args.requests:
            batch = read_requests(args.requests, defaults)
        else:
            # The flags are checked before the checkpoint is loaded.
            template = make_request(defaults, encode(""), lambda field: FIELDS.get(field, field))
        engine = load_engine(args)

        def write(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        if args.prompt is not None:
            write(args.prompt)
            stream_one(engine, request_for(template, args.prompt), write)
            write("\n")
        elif args.interactive:
            for line in sys.stdin:
                prompt = line.rstrip("\n")
                write(prompt)
                stream_one(engine, request_for(template, prompt), write)
                write("\n")
        else:
            ids = [submit(engine, request, where) for _, request, _, where in batch]
            results = {}
            for event in engine.stream():
                if event.finish_reason is not None:
                    results[event.request_id] = engine.completion(event.request_id)
            lines = [json.dumps(result_line(request_id, text, results[engine_id]))
                     for (request_id, _, text, _), engine_id in zip(batch, ids)]
            if args.out:
                with open(args.out, "w", encoding="utf-8") as f:
                    f.write("\n".join(lines) + "\n")
            else:
                write("\n".join(lines) + "\n")


def request_for(template: Request, prompt: str) -> Request:
    """`template`'s settings for the text `prompt` (led by BOS)."""
    return Request(encode(prompt), template.sampling, seed=template.seed,
                   max_tokens=template.max_tokens, stop_tokens=template.stop_tokens)


if __name__ == "__main__":
    main()

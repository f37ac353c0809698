"""Grammar-constrained decoding with xgrammar: specs, compilation off the step thread, per-sequence matchers.

A request names its constraint as a `StructuredSpec` (JSON schema, any JSON object, regex, a choice
of strings, an EBNF grammar, or tool calls in the model's template format). It is compiled against
the engine's tokenizer on a thread of its own, before the request is queued (an invalid schema is a
ValueError naming it: a 400), and cached by spec, so a burst of one schema compiles once. Each
sequence (every choice of n / best_of) gets its own matcher; the controller fills the matcher's
token bitmask into the step plan for every row it samples and advances the matcher with the token
the step produced (workers/controller.py). The workers apply the mask to the logits from a fixed
buffer (workers/sampler.py). Vocabulary rows past the tokenizer's (padding) are never allowed;
EOS only where the grammar accepts; a token that would make the output ill-formed UTF-8 never
(workers/utf8_masks.py: xgrammar's character classes let some through).
"""
from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

from workers.utf8_masks import ERROR, GROUND, Utf8Masks

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tool_calls")
CACHE_SIZE = 256                   # compiled grammars kept (LRU by spec)
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


JSON_OBJECT = {"type": "object", "additionalProperties": True}


class GrammarError(ValueError):
    """The constraint cannot be compiled (invalid or unsupported schema, regex or grammar)."""


@dataclass(frozen=True)
class CompiledGrammar:
    """xgrammar's compiled grammar with the tokenizer's UTF-8 masks, which every matcher of it applies too."""
    grammar: object
    utf8: Utf8Masks


@dataclass(frozen=True)
class StructuredSpec:
    """What a request's output must match. `value`: canonical JSON of a schema, of a list of choices or of
    the tool-call spec, or the regex / EBNF text; the cache key as it stands."""
    kind: str
    value: str = ""
    field: str = "response_format"     # the request field it came from (named in errors)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")

    @classmethod
    def json_schema(cls, schema, field: str = "response_format") -> StructuredSpec:
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"{field}: the JSON schema must be an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema), field)   # key order kept: properties come out in it

    @classmethod
    def tool_calls(cls, tools: list[tuple[str, dict]], parallel: bool) -> StructuredSpec:
        """One or more (or, not parallel, exactly one) hermes-style calls of the given (name, parameters)."""
        value = json.dumps({"tools": [[n, p] for n, p in tools], "parallel": parallel}, sort_keys=True)
        return cls("tool_calls", value, "tool_choice")


def tool_call_begin(name: str) -> str:
    """Qwen3's (hermes) tool-call framing, as its chat template writes it; the arguments object follows."""
    return '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": '


TOOL_CALL_END = "}\n</tool_call>"


class GrammarCompiler:
    """Compiles specs on one background thread (xgrammar is imported there too: ~3 s on first use)."""

    def __init__(self, tokenizer_path, vocab_size: int, stop_token_ids):
        # its own tokenizer instance (read on the compile thread): a Rust tokenizer is not shared across threads
        self._tokenizer_path, self.vocab_size, self._stop = tokenizer_path, vocab_size, sorted(stop_token_ids)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._cache: OrderedDict[StructuredSpec, concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = self._utf8 = None
        self.num_compiled = 0              # compilations run (cache misses), for tests and stats
        # xgrammar's import and the tokenizer's info (a pass over the vocabulary) at start-up, on the grammar
        # thread: not in the first constrained request's TTFT, nor holding the GIL beside its first steps
        self._executor.submit(self._get_compiler)

    def compile(self, spec: StructuredSpec) -> concurrent.futures.Future:
        """A future of the compiled grammar; the same future for the same spec while it is cached."""
        key = StructuredSpec(spec.kind, spec.value)            # the field it came from is not part of the key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:                             # compiling or compiled (an error stays one)
                self._cache.move_to_end(key)
                return _named(future, spec)
            future = self._executor.submit(self._compile, key)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return _named(future, spec)

    def compile_now(self, spec: StructuredSpec):
        return self.compile(spec).result()

    def _compile(self, spec: StructuredSpec) -> CompiledGrammar:
        compiler = self._get_compiler()
        self.num_compiled += 1
        return CompiledGrammar(self._compile_xgrammar(compiler, spec), self._utf8)

    @staticmethod
    def _compile_xgrammar(compiler, spec: StructuredSpec):
        try:
            if spec.kind == "json_schema":
                return compiler.compile_grammar(json_grammar(json.loads(spec.value), any_whitespace=False))
            if spec.kind == "json_object":   # OpenAI's: an object (xgrammar's builtin JSON is any value)
                return compiler.compile_grammar(json_grammar(JSON_OBJECT, any_whitespace=False, strict_mode=False))
            if spec.kind == "regex":
                return compiler.compile_regex(spec.value)
            if spec.kind == "choice":
                return compiler.compile_regex("|".join(re.escape(c) for c in json.loads(spec.value)))
            if spec.kind == "grammar":
                return compiler.compile_grammar(spec.value)
            return compiler.compile_structural_tag(_tool_call_tag(spec.value))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(_clean(exc)) from None

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self._stop)
            self._utf8 = Utf8Masks(info.decoded_vocab, self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _named(future: concurrent.futures.Future, spec: StructuredSpec) -> concurrent.futures.Future:
    """The shared future, its error prefixed with the field this request named the constraint in."""
    out: concurrent.futures.Future = concurrent.futures.Future()

    def done(f: concurrent.futures.Future) -> None:
        exc = f.exception()
        if exc is None:
            out.set_result(f.result())
        else:
            out.set_exception(GrammarError(f"{spec.field}: {spec.kind} is invalid or unsupported: {exc}")
                              if isinstance(exc, GrammarError) else exc)

    future.add_done_callback(done)
    return out


def _clean(exc: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _XGRAMMAR_PREFIX.sub("", text)[:500]


# JSON string characters as code points: printable ASCII but `"` and `\`, then every other code point but
# control characters and surrogates (no escapes: each character stands for itself, as JSON Schema counts
# them; U+FFFE and U+FFFF left out); those past U+FFFF as themselves: xgrammar's regex has no escape for them
STRING_CHARS = "[ !#-\\[\\]-~\\u00a0-\\ud7ff\\ue000-\\ufffd\U00010000-\U0010ffff]"


# xgrammar 0.2.9's escape rule, and the same without the escapes of surrogates (\uD800..\uDFFF): a lone one
# decodes to a string that is not Unicode (a character past U+FFFF is written as itself instead of as a pair)
_ESCAPE_RULE = 'basic_escape ::= (([\\"\\\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))'
_UNICODE_ESCAPE_RULE = ('basic_escape ::= (([\\"\\\\/bfnrt]) | ("u" (([0-9A-Ca-cEFef] [A-Fa-f0-9]) | ([Dd] [0-7])) '
                        '[A-Fa-f0-9] [A-Fa-f0-9]))')


def json_grammar(schema, **options) -> str:
    """The EBNF of a JSON schema (xgrammar's, `options` its from_json_schema's), its strings made safe:
    plain ones by _safe_strings, the builtin rule's escapes by _UNICODE_ESCAPE_RULE."""
    import xgrammar as xgr
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(_safe_strings(schema)), **options))
    if ebnf.count(_ESCAPE_RULE) != 1:   # another xgrammar: its rule must be read again (a 500, not the caller's)
        raise LookupError("xgrammar's JSON string escape rule is not the one workers/grammar.py replaces")
    return ebnf.replace(_ESCAPE_RULE, _UNICODE_ESCAPE_RULE)


def _safe_strings(schema):
    """Plain string schemas as patterns of STRING_CHARS. xgrammar 0.2.9 compiles a string with minLength /
    maxLength to a class excluding only quote, backslash, CR and LF, which also passes raw control
    characters (a tab): invalid JSON, or more characters than maxLength once decoded. The same bounds over
    STRING_CHARS keep it valid JSON, one character per code point. (Its byte sequences are kept well-formed
    UTF-8 by the matcher's masks, workers/utf8_masks.py: the class alone does not.) xgrammar ignores lengths
    beside a pattern or format: refused rather than served unchecked."""
    if isinstance(schema, list):
        return [_safe_strings(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _safe_strings(value) for key, value in schema.items()}
    kinds = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    if "string" in kinds and {"pattern", "format"} & out.keys() and {"minLength", "maxLength"} & out.keys():
        raise GrammarError("a string's minLength / maxLength together with a pattern or format is not supported")
    if "string" in kinds and not ({"pattern", "format", "enum", "const"} & out.keys()):
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^{STRING_CHARS}{{{low},{high}}}$"
    return out


def _tool_call_tag(value: str) -> str:
    """Calls separated by a newline, each `<tool_call>\\n{"name": N, "arguments": ARGS}\\n</tool_call>` with
    ARGS valid against that function's parameters: one at least, only one unless parallel."""
    spec = json.loads(value)
    tags = [{"type": "tag", "begin": tool_call_begin(name), "end": TOOL_CALL_END,
             # at most one whitespace character in a row (a random or drifting model could pad forever)
            "content": {"type": "grammar", "grammar": json_grammar(params, max_whitespace_cnt=1)}}
            for name, params in spec["tools"]]
    return json.dumps({"type": "structural_tag",
                       "format": {"type": "tags_with_separator", "tags": tags, "separator": "\n",
                                  "at_least_one": True, "stop_after_first": not spec["parallel"]}})


class GrammarMatcher:
    """One sequence's position in its grammar and in the UTF-8 character it may be in the middle of."""

    def __init__(self, compiled: CompiledGrammar):
        import xgrammar as xgr
        self._matcher, self._utf8, self._utf8_state = xgr.GrammarMatcher(compiled.grammar), compiled.utf8, GROUND

    def fill_bitmask(self, bitmask, row: int) -> None:
        """Row `row` of the int32 bitmask [rows, ceil(vocab / 32)]: bit v of the row set = token v allowed."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        bitmask[row] &= self._utf8.bitmask[self._utf8_state]

    def accept(self, token: int) -> bool:
        self._utf8_state = int(self._utf8.next_state[self._utf8_state, token])
        return self._utf8_state != ERROR and self._matcher.accept_token(token)

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32

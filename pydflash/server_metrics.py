"""What the server's finished generations add up to, for llama-server's `GET /metrics` (Prometheus text, served
with `--metrics`): its metric names, from each generation's timings (as the slots hand them over, `SlotPool`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# (name, help) of the counters, in llama-server's names and order
COUNTERS = (
    ("prompt_tokens_total", "Prompt tokens evaluated, the cached ones left out"),
    ("prompt_tokens_cached_total", "Prompt tokens reused from a slot's cache"),
    ("prompt_seconds_total", "Seconds spent evaluating prompts"),
    ("tokens_predicted_total", "Tokens generated"),
    ("tokens_predicted_seconds_total", "Seconds spent generating tokens"),
    ("n_decode_total", "Target evaluations of generated tokens (plain steps and verifies; a batched step counts "
                       "once for each slot in it)"),
    ("n_tokens_max", "Longest sequence seen (prompt and generated tokens)"),
    ("spec_decode_num_draft_tokens_total", "Speculative: draft tokens verified"),
    ("spec_decode_num_accepted_tokens_total", "Speculative: draft tokens the target accepted"),
    ("spec_decode_num_drafts_total", "Speculative: verify steps that held drafts"),
)
GAUGES = (
    ("prompt_tokens_seconds", "Prompt tokens per second since the last read of /metrics"),
    ("predicted_tokens_seconds", "Generated tokens per second since the last read of /metrics"),
    ("requests_processing", "Requests being generated (busy slots)"),
    ("requests_deferred", "Requests waiting for a slot"),
    ("n_busy_slots_per_decode", "Slots per batched target evaluation, on average (1 without batching)"),
)


@dataclass
class ServerMetrics:
    """Totals over the finished generations (record), and the tokens and time since the last read (the rate
    gauges, as llama-server's buckets)."""
    totals: dict = field(default_factory=lambda: dict.fromkeys((name for name, _ in COUNTERS), 0))
    since_read: dict = field(default_factory=lambda: dict(prompt_n=0, prompt_s=0.0, predicted_n=0, predicted_s=0.0))
    started: float = field(default_factory=time.time)

    def record(self, timings: dict) -> None:
        """One finished generation's timings (pydflash's: llama-server's names plus the draft statistics)."""
        t, b = self.totals, self.since_read
        prompt_s, predicted_s = timings["prompt_ms"] / 1e3, timings["predicted_ms"] / 1e3
        t["prompt_tokens_total"] += timings["prompt_n"]
        t["prompt_tokens_cached_total"] += timings.get("cached_n", 0)
        t["prompt_seconds_total"] += prompt_s
        t["tokens_predicted_total"] += timings["predicted_n"]
        t["tokens_predicted_seconds_total"] += predicted_s
        t["n_decode_total"] += timings.get("n_target_evals", 0)
        t["n_tokens_max"] = max(t["n_tokens_max"], timings["prompt_n"] + timings.get("cached_n", 0)
                                + timings["predicted_n"])
        t["spec_decode_num_draft_tokens_total"] += timings.get("draft_n", 0)
        t["spec_decode_num_accepted_tokens_total"] += timings.get("draft_n_accepted", 0)
        t["spec_decode_num_drafts_total"] += timings.get("n_rounds", 0)
        b["prompt_n"] += timings["prompt_n"]
        b["prompt_s"] += prompt_s
        b["predicted_n"] += timings["predicted_n"]
        b["predicted_s"] += predicted_s

    def prometheus(self, processing: int, deferred: int, slots_per_step: float) -> str:
        """The exposition text (counters, then gauges), and the rates started afresh."""
        b = self.since_read
        gauges = dict(prompt_tokens_seconds=b["prompt_n"] / b["prompt_s"] if b["prompt_s"] > 0 else 0.0,
                      predicted_tokens_seconds=b["predicted_n"] / b["predicted_s"] if b["predicted_s"] > 0 else 0.0,
                      requests_processing=processing, requests_deferred=deferred,
                      n_busy_slots_per_decode=slots_per_step)
        self.since_read = dict.fromkeys(b, 0)
        lines = []
        for kind, items, values in (("counter", COUNTERS, self.totals), ("gauge", GAUGES, gauges)):
            for name, help_text in items:
                lines += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}",
                          f"llamacpp:{name} {values[name]}"]
        return "\n".join(lines) + "\n"

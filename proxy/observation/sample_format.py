"""How a generated sample is shown to a person: the one formatter for the proxy's
audit log lines and for `python -m proxy sample`.

    sample @150 [repo-code] held-out 5.260 (temperature 0.8, top-k 40)
        prompt | omes
          text |                         the result of the current yield-expression
               |         throw           if if be called to be used.

The prompt and the continuation are shown apart, each with its real line breaks, indented under
the heading line behind a margin (so leading spaces stay visible and a log reader can tell the
sample from the next log line). Control characters other than tab and newline are escaped
(`\\x13`), so a half-trained model cannot corrupt a terminal.

What it is not: the audit itself (worker/trainer.py `sample_audit`) or `.samples.json`
(proxy/run_files/sidecars.py), which keep the raw strings.
"""

from __future__ import annotations

MAX_LINES = 24  # per part in the log; the rest is summarised as "(N more lines)"
_LABEL = 10  # width of the "prompt" / "text" column


def _printable(line: str) -> str:
    return "".join(c if c == "\t" or c.isprintable() else repr(c)[1:-1] for c in line)


def _block(label: str, text: str, indent: str, max_lines: int | None) -> list[str]:
    shown = text.split("\n")[:max_lines]
    more = text.count("\n") + 1 - len(shown)
    out = []
    for i, line in enumerate(shown):
        head = label if i == 0 else ""
        out.append(f"{indent}{head:>{_LABEL}} |" + (f" {_printable(line)}" if line else ""))
    if more > 0:
        out.append(f"{indent}{'':>{_LABEL}} | ... ({more} more lines)")
    return out


def format_sample(
    heading: str, prompt: str, text: str, indent: str = "", max_lines: int | None = MAX_LINES
) -> str:
    """`heading` on the first line, then the prompt and the continuation, each line behind a
    margin ("    prompt | ...", "      text | ..."). Each part shows at most `max_lines` lines
    and says how many more there were (the log's audits); None shows everything (the `sample`
    command, whose user asked for that many tokens). Returns one string with real newlines and
    no trailing newline; an empty continuation is shown as "(nothing)"."""
    lines = [heading] + _block("prompt", prompt, indent, max_lines)
    lines += (
        _block("text", text, indent, max_lines)
        if text
        else [f"{indent}{'text':>{_LABEL}} | (nothing)"]
    )
    return "\n".join(lines)


def format_audit(audit: dict) -> list[str]:
    """One formatted block per arm of an audit report (`{"step", "arms": {name: {"prompt",
    "text", "loss", "temperature"?, "top_k"?}}}`, docs/architecture.md#the-worker), in arm order."""
    out = []
    for arm, a in audit["arms"].items():
        extra = ""
        if a.get("temperature") is not None:
            extra = f" (temperature {a['temperature']}, top-k {a.get('top_k')})"
        loss = a.get("loss")
        held = f" held-out {loss:.3f}" if isinstance(loss, (int, float)) else ""
        out.append(
            format_sample(
                f"sample @{audit['step']} [{arm}]{held}{extra}",
                a.get("prompt", ""),
                a.get("text", ""),
            )
        )
    return out

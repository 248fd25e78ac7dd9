"""Text -> IPA phonemes (espeak-ng, as Piper does) -> the voice's phoneme ids.

espeak-ng drops punctuation from its IPA output, so text is split at clause
punctuation first and each clause phonemized alone; the punctuation goes back
between clauses (Piper's voices have ids for it: pauses and intonation).
Ids follow Piper: BOS `^`, then every phoneme's ids followed by the pad `_`,
then EOS `$`; characters the voice has no id for are skipped.
"""
from __future__ import annotations

import re
import shutil
import subprocess

from flare.core.errors import InputError, ModelError

CLAUSE = re.compile(r"([,;:.!?]+)")
SENTENCE = re.compile(r"(?<=[.!?])\s+")
MAX_CHARS = 5000


def sentences(text: str) -> list[str]:
    text = " ".join(text.split())
    if not text:
        raise InputError("piper: the text is empty")
    if len(text) > MAX_CHARS:
        raise InputError(f"piper: the text has {len(text)} characters (at most {MAX_CHARS} per call)")
    return [s for s in SENTENCE.split(text) if s.strip()]


def espeak(text: str, voice: str) -> str:
    """IPA of one clause from the espeak-ng command (no shell; text passed as an argument)."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise ModelError("piper: espeak-ng is not installed (scripts/install-system.sh installs it)")
    done = subprocess.run([exe, "-q", "--ipa", "-v", voice, "--", text], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise ModelError(f"piper: espeak-ng failed ({done.returncode}): {done.stderr.strip()[:200]}")
    return " ".join(line.strip() for line in done.stdout.splitlines() if line.strip())


def phonemize(sentence: str, voice: str) -> str:
    parts = CLAUSE.split(sentence)
    out = []
    for i in range(0, len(parts), 2):
        clause = parts[i].strip()
        punct = parts[i + 1] if i + 1 < len(parts) else ""
        if clause:
            if out:
                out.append(" ")
            out.append(espeak(clause, voice))
        out.append(punct)
    return "".join(out)


def to_ids(phonemes: str, id_map: dict[str, list[int]]) -> list[int]:
    pad, bos, eos = id_map["_"], id_map["^"], id_map["$"]
    ids = list(bos) + list(pad)
    for ch in phonemes:
        if ch in id_map:
            ids += id_map[ch] + pad
    return ids + list(eos)

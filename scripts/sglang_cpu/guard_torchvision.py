"""Guard the start-up imports of torchvision in sglang 0.5.23, in the SGLang CPU test environment only
(scripts/sglang_cpu_venv.sh runs this with that environment's Python).

`sglang.launch_server` imports sglang/srt/configs/__init__.py, which imports the configs of image
models whose modules import torchvision at their top (`FILES` below); they use it only inside their
image preprocessing functions. The registry's torchvision wheels are built against CUDA torch: beside
torch 2.13.0+cpu, `import torchvision` fails (`operator torchvision::nms does not exist`), and the
pair that imports together (torch 2.14.1 + torchvision 0.29.1) is a 5.5 GB CUDA build. So torchvision
is not installed, and in each of these files its import lines are moved into one
`try: ... except ImportError:` block that binds the imported names to None: text models never reach
them; an image model fails at its first image. Nothing else changes; a file that does not hold exactly
the expected lines stops the build.
"""

import importlib.util
import pathlib
import sys

FILES = {
    "sglang.srt.multimodal.internvl_utils": ("import torchvision.transforms as T",
                                             "from torchvision.transforms.functional import InterpolationMode"),
    "sglang.srt.configs.deepseek_ocr": ("from torchvision.transforms import InterpolationMode",
                                        "from torchvision.transforms import functional as TF"),
}
GUARD = "try:  # guarded: no torchvision in this CPU environment (glmlight scripts/sglang_cpu/guard_torchvision.py)\n"


def bound_name(line: str) -> str:
    return line.split(" as ")[-1] if " as " in line else line.split()[-1]


for module, lines in FILES.items():
    path = pathlib.Path(importlib.util.find_spec(module.rsplit(".", 1)[0]).submodule_search_locations[0],
                        module.rsplit(".", 1)[1] + ".py")
    text = path.read_text()
    if GUARD in text:
        continue
    if any(text.count(line + "\n") != 1 for line in lines):
        sys.exit(f"{path}: the torchvision imports to guard are not there as expected; not patched")
    block = GUARD + "".join(f"    {line}\n" for line in lines) + "except ImportError:\n    " + \
        " = ".join(bound_name(line) for line in lines) + " = None\n"
    for line in lines[1:]:
        text = text.replace(line + "\n", "", 1)
    path.write_text(text.replace(lines[0] + "\n", block, 1))

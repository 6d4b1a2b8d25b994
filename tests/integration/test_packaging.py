"""The installed package: one top-level package (glmlight), the callbacks as glmlight.callbacks and the
configs as package data, so a wheel installed anywhere composes its configs and trains from any directory."""

import glob
import os
import site
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from tests.conftest import REPO

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def test_pyproject_lists_every_package_on_disk():
    listed = set(tomllib.load(open(os.path.join(REPO, "pyproject.toml"), "rb"))["tool"]["setuptools"]["packages"])
    on_disk = {os.path.relpath(os.path.dirname(p), REPO).replace(os.sep, ".")
               for p in glob.glob(os.path.join(REPO, "glmlight", "**", "__init__.py"), recursive=True)}
    assert listed == on_disk | {"glmlight.callbacks", "glmlight.conf"}


def running_site_packages():
    """The directories the running interpreter imports its installed packages from: its environment's
    site-packages, the base Python's when that environment includes them, and the user site when enabled.
    Inside a virtual environment these are the venv's own directories; outside one, the system Python's."""
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    here = os.path.realpath(REPO)
    out = []
    for d in dirs:
        if os.path.isdir(d) and d not in out and not os.path.realpath(d).startswith(here):
            out.append(d)
    return out


def see_the_running_environment(py):
    """Let the fresh environment at `py` import the running environment's packages (torch, lightning, ...)
    without installing them again. `venv --system-site-packages` would not do: it exposes the *base*
    Python's site-packages, which has no torch when the tests run inside a virtual environment. A .pth
    file in the fresh environment's site-packages appends the running environment's directories to
    sys.path after its own, so what is installed into it (the wheel) comes first. The directories are
    added as plain paths: their own .pth files are not run, so an editable install of glmlight in the
    running environment (a finder pointing at the source tree) stays invisible."""
    target = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                            check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(target, "_running_environment.pth"), "w") as f:
        f.write("".join(d + "\n" for d in running_site_packages()))


def test_a_built_wheel_installs_alone_and_trains_from_another_directory(tmp_path):
    """Build the wheel, install it (not editable) into a fresh environment, train one step from outside the
    repository: the configs come from the installed package, and nothing but glmlight is top-level."""
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    REPO], check=True, capture_output=True)
    wheel = glob.glob(str(dist / "glmlight-*.whl"))[0]
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"glmlight", os.path.basename(wheel).split("-py")[0] + ".dist-info"}
    assert "glmlight/conf/train.yaml" in names and "glmlight/conf/algo/grpo.yaml" in names
    assert "glmlight/callbacks/weight_sync.py" in names
    assert "glmlight/data/word_problems/train.jsonl" in names  # experiment=smollm2_math's data
    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True)
    py = str(env_dir / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", wheel], check=True, capture_output=True)
    see_the_running_environment(py)  # after the install: pip sees nothing but the fresh environment
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([py, "-c", "import glmlight, glmlight.callbacks as c, glmlight.config.compose as l; "
                                      "print(glmlight.__file__); print(c.__file__); print(l.CONF_DIR)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert all(p.startswith(str(env_dir)) for p in where), where
    path = subprocess.run([py, "-c", "import sys; print('\\n'.join(sys.path))"], cwd=elsewhere, env=env,
                          capture_output=True, text=True, check=True).stdout.split()
    assert not [p for p in path if os.path.realpath(p).startswith(os.path.realpath(REPO))], path
    out = subprocess.run([py, "-m", "glmlight.run.train", "model.preset=test", "model.warm_start.steps=0",
                          "trainer.max_steps=1", "logger=none", "rollout.rollout_batch_size=2",
                          "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=3", "task.num_eval_prompts=4",
                          "trainer.enable_progress_bar=false"], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert os.path.isfile(elsewhere / "runs" / "default" / "hf" / "model.safetensors")


def test_no_config_names_a_callback_by_its_folder():
    """The callbacks are the package glmlight.callbacks: a `_target_` that names the folder (`callbacks.X`) imports
    only from a checkout's root, as a second copy of every class, and fails in an installed glmlight."""
    import re
    import subprocess

    files = subprocess.run(["git", "ls-files", "*.py", "*.yaml", "*.md"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    bad = [f for f in files if re.search(r"_target_\s*[=:]\s*callbacks\.", open(os.path.join(REPO, f)).read())]
    assert bad == []

"""Package layout: `flare` is a namespace package spread over four folders,
each holding one layer under its own name (core/flare/core, backends/flare/backends,
plugins/flare/plugins, models/flare/models). Putting the four folders on the path is
all an editor, import-linter or a plain `PYTHONPATH=core:backends:plugins:models`
needs to follow every import; setuptools is told where each layer lives so the wheel
and an editable install hold the same modules."""
from setuptools import find_namespace_packages, setup

LAYERS = ("core", "backends", "plugins", "models")

packages = []
package_dir = {}
for layer in LAYERS:
    root = f"flare.{layer}"
    package_dir[root] = f"{layer}/flare/{layer}"
    packages.append(root)
    # namespace discovery also lists data folders (shaders/, kernels/, data/) so their files ship
    packages += [f"{root}.{sub}" for sub in
                 find_namespace_packages(f"{layer}/flare/{layer}", exclude=["*__pycache__*"])]

# `flare.session` (core/flare/session/): the quickstart's import path before the runtime
# moved to `flare.core`, kept so existing code keeps working
packages.append("flare.session")
package_dir["flare.session"] = "core/flare/session"
setup(packages=packages, package_dir=package_dir)

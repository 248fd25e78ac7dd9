"""Package layout: the design puts the import package `flare` in `core/` and
its plugin subpackages in sibling folders; setuptools needs that mapping
spelled out, and the subpackage list is found here so nobody keeps it by hand."""
from setuptools import find_namespace_packages, setup

ROOTS = {
    "flare": "core",
    "flare.plugins": "plugins",
    "flare.backends": "backends",
    "flare.models": "models",
}

packages = []
for package, folder in ROOTS.items():
    packages.append(package)
    # namespace discovery also lists data folders (shaders/, kernels/, data/) so their files ship
    packages += [f"{package}.{sub}" for sub in find_namespace_packages(folder, exclude=["*__pycache__*"])]

setup(packages=packages, package_dir=ROOTS)

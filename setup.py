"""Package layout: the design puts the import package `flare` in `core/` and
its plugin subpackages in sibling folders; setuptools needs that mapping
spelled out, and the subpackage list is found here so nobody keeps it by hand."""
from setuptools import find_packages, setup

ROOTS = {
    "flare": "core",
    "flare.plugins": "plugins",
    "flare.backends": "backends",
    "flare.models": "models",
}

packages = []
for package, folder in ROOTS.items():
    packages.append(package)
    packages += [f"{package}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=ROOTS)

"""Maps the four root layer folders onto the ``mlx_dspark.*`` import names (see architecture.md).

``mlx_dspark`` itself (``load`` and ``python -m mlx_dspark``) comes from ``entrypoints/_package``.
"""

from setuptools import find_packages, setup

LAYERS = ("domain", "adapters", "application", "entrypoints")
ROOT = "entrypoints/_package"

setup(
    packages=[
        "mlx_dspark",
        *(
            f"mlx_dspark.{p}"
            for p in find_packages(include=[f"{layer}*" for layer in LAYERS], exclude=["entrypoints._package"])
        ),
    ],
    package_dir={"mlx_dspark": ROOT, **{f"mlx_dspark.{layer}": layer for layer in LAYERS}},
    package_data={
        **{f"mlx_dspark.{layer}": ["py.typed"] for layer in LAYERS},
        "mlx_dspark.adapters": ["**/*.json", "**/*.safetensors", "**/*.c", "**/*.md", "**/*.jsonl"],
        "mlx_dspark.entrypoints": ["**/*.html", "**/*.js", "**/*.css", "**/*.md", "**/*.svg"],
        "mlx_dspark.application": ["**/*.jsonl", "**/*.json"],
    },
)

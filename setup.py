"""fairseq-agg: AGG, augmented loss, MLRA and embedding statistics as a fairseq --user-dir plugin."""
import os

from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "README.md"), encoding="utf-8") as f:
    long_description = f.read()

setup(
    name="fairseq-agg",
    version="0.1.0",
    description=(
        "Adaptive Gradient Gating, augmented loss (REAL), MLRA attention and token-embedding "
        "statistics for fairseq, as a --user-dir plugin"
    ),
    long_description=long_description,
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["fairseq_agg", "fairseq_agg.*"]),
    install_requires=[
        "torch>=2.1,<3",
        # Stock fairseq 0.12.2 neither builds nor imports on Python >= 3.11; fairseq-fixed is a
        # maintained fork of fairseq main with the same import name. Build it with
        # --no-build-isolation after torch (scripts/setup_env.sh does this).
        'fairseq-fixed==0.12.3.1; python_version >= "3.11"',
        'fairseq>=0.12.2; python_version < "3.11"',
        "sacrebleu>=2",
        "sacremoses",  # tokenized (compound-split) BLEU of the WMT14 example
        "sentencepiece",
        "numpy",
        "tensorboardX",
        "matplotlib",
    ],
    extras_require={"test": ["pytest>=7"]},
    entry_points={
        "console_scripts": [
            "fairseq-agg=fairseq_agg.cli:main",
            "fairseq-agg-analyze=fairseq_agg.stats.analyze:main",
        ],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: MIT License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)

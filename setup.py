from setuptools import find_packages, setup

setup(
    name="trl_diffusion",
    version="0.1.0.dev0",
    description="Post-training for diffusion language models (SDAR/TraDo, LLaDA, Dream) on top of TRL.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",  # TRL 1.16 (and transformers >= 5.24) require it
    packages=find_packages(include=["trl_diffusion", "trl_diffusion.*"]),
    # the embedded model's files and the recipes, named so that bytecode (assets/__pycache__) is not shipped as data
    package_data={"trl_diffusion": ["assets/tiny-sdar-arithmetic/*", "recipes/*.yaml"]},
    include_package_data=True,
    exclude_package_data={"": ["__pycache__", "*.py[cod]"]},
    install_requires=[
        "torch>=2.6,<2.16",
        "transformers>=5.20,<6",
        "trl>=1.16,<1.17",
        "peft>=0.21,<0.23",
        "accelerate>=1.15,<1.17",
        "datasets>=5.0.1,<6",  # 5.0.0 failed on a JSON list of rows behind a byte-order mark
        "math-verify>=0.9,<0.10",
        "tokenizers>=0.23.1",
        "safetensors>=0.8",
        "matplotlib>=3.9",  # training-curve PNGs of the examples (3.7 fails to import beside numpy 2)
        # imported directly, so declared here though the libraries above pull them in (floors: what those libraries'
        # oldest admitted releases already require; packaging 22 is pytest 9.1's floor)
        "numpy>=1.26",
        "pyarrow>=21",
        "sympy>=1.13.1",  # torch 2.6 pins sympy 1.13.1
        "tqdm>=4.66.3",
        "packaging>=22",
        "huggingface_hub>=1.31",
        "latex2sympy2_extended>=1.11",  # math-verify's parser (0.9 pins 1.11.0), whose unit rule the math reward reads
    ],
    extras_require={
        "flash": ["flash-attn>=2.7"],
        "deepspeed": ["deepspeed>=0.19"],  # ZeRO-2/3 (accelerate's DeepSpeed plugin); tested on the CPU with 0.19.8
        # setuptools: the packaging tests build the sdist and a wheel with it, offline (bdist_wheel is built in since
        # 70.1; torch 2.13 needs >= 77.0.3 anyway, torch 2.6 none on Python 3.11)
        "dev": ["pytest>=8", "pytest-xdist>=3.8", "ruff>=0.6", "deepspeed>=0.19", "setuptools>=70.1"],
    },
    entry_points={"console_scripts": ["trl-diffusion=trl_diffusion.cli:main"]},
)

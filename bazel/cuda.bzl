"""`cuda_library`: compiles .cu files with nvcc (Bazel 4 has no CUDA rules).

Each .cu file is compiled by nvcc in a genrule (the toolkit comes from @local_cuda, see
cuda_configure.bzl) and the objects are wrapped in a cc_library tagged "manual" and "gpu", so
`bazel build //...` never runs nvcc. Use cuda_library targets only behind --config=cuda (a
select() on //cuda:cuda_enabled) or from manual targets.
"""

load("@local_cuda//:defs.bzl", "CUDA_FOUND", "CUDA_NVCC", "CUDA_PATH")

# Ampere (A100) and Hopper (H100/H200) machine code, plus compute_90 PTX so that newer GPUs can
# JIT-compile the kernels.
CUDA_GENCODE = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
]

NVCC_FLAGS = [
    "-std=c++17",
    "-O2",
    "-Xcompiler=-fPIC,-Wall,-Wextra",
    # Warnings in our device code fail the build, as -Werror does for host code.
    "-Werror=all-warnings",
] + CUDA_GENCODE

def cuda_library(name, srcs, hdrs = [], private_hdrs = [], deps = [], visibility = None,
                 testonly = False):
    """A cc_library of .cu files compiled by nvcc; only ever built under --config=cuda.

    Args:
      name: the cc_library.
      srcs: .cu files; each becomes one object (compiled with -fPIC, usable in any link).
      hdrs: headers of this library, also the only workspace headers the .cu files may include
        (the nvcc action sees just these, private_hdrs, the toolkit's and the system's).
      private_hdrs: headers the .cu files include that are not part of this library's API.
      deps: cc_library deps for the link (the CUDA runtime is added).
      visibility: as for cc_library.
      testonly: as for cc_library.
    """
    objects = []
    for src in srcs:
        if not src.endswith(".cu"):
            fail("cuda_library %s: %s is not a .cu file" % (name, src))
        obj = "_nvcc/%s/%s.o" % (name, src[:-3])
        if CUDA_FOUND:
            cmd = " ".join([CUDA_NVCC] + NVCC_FLAGS + [
                "-I.",
                "-I$(GENDIR)",
                "-c",
                "$(location %s)" % src,
                "-o",
                "$@",
            ])
        else:
            cmd = "echo %s >&2; exit 1" % repr(
                "refit: cannot compile %s: no CUDA toolkit at %s (see bazel/cuda.bzl)" %
                (src, CUDA_PATH),
            )
        native.genrule(
            name = "%s_%s_nvcc" % (name, src[:-3].replace("/", "_")),
            srcs = [src] + hdrs + private_hdrs,
            outs = [obj],
            cmd = cmd,
            message = "Compiling %s with nvcc" % src,
            tags = ["manual", "gpu"],
            testonly = testonly,
            visibility = ["//visibility:private"],
        )
        objects.append(obj)
    native.cc_library(
        name = name,
        srcs = objects + private_hdrs,
        hdrs = hdrs,
        deps = deps + ["@local_cuda//:cudart"],
        alwayslink = True,
        # Never a shared object of its own (as cc_test links libraries in fastbuild): the
        # static CUDA runtime has to resolve against these objects in the final link.
        linkstatic = True,
        tags = ["manual", "gpu"],
        testonly = testonly,
        visibility = visibility,
    )

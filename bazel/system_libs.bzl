"""Debian's system libraries exposed as Bazel cc_library targets in @system_libs.

A repository rule asks pkg-config for each library's flags at fetch time: -D flags become
`defines`, -l/-L/-pthread flags become `linkopts`. Headers stay on the compiler's default system
include path, so their warnings stay quiet under -Werror.
"""

# name -> (pkg-config modules, linkopts used when there is no .pc file)
_LIBRARIES = {
    "absl": (["absl_status", "absl_statusor", "absl_strings", "absl_str_format", "absl_synchronization", "absl_time"], []),
    "benchmark": (["benchmark"], ["-lbenchmark", "-lpthread"]),
    "catch2": ([], []),
    "civetweb": ([], ["-lcivetweb"]),
    "cli11": ([], []),
    "grpc++": (["grpc++"], []),
    "grpc_reflection": ([], ["-lgrpc++_reflection"]),
    "json": ([], []),
    "openssl": (["libcrypto"], []),
    "protobuf": (["protobuf"], []),
    "spdlog": (["spdlog"], []),
    "systemd": (["libsystemd"], []),
    "tomlplusplus": ([], []),
    "ucx": (["ucx"], []),
    "xxhash": (["libxxhash"], []),
    "zstd": (["libzstd"], []),
}

def _words(text):
    return [w for w in text.replace("\n", " ").replace("\t", " ").split(" ") if w]

def _flags(ctx, modules):
    if not modules:
        return [], []
    cflags = ctx.execute(["pkg-config", "--cflags"] + modules)
    libs = ctx.execute(["pkg-config", "--libs"] + modules)
    if cflags.return_code != 0 or libs.return_code != 0:
        fail("pkg-config failed for %s: %s%s (run scripts/install/install-deps.sh)" %
             (modules, cflags.stderr, libs.stderr))
    defines = [f[2:] for f in _words(cflags.stdout) if f.startswith("-D")]
    linkopts = [f for f in _words(libs.stdout) if f.startswith("-l") or f.startswith("-L") or f == "-pthread"]
    return defines, linkopts

def _system_libs_impl(ctx):
    lines = ['package(default_visibility = ["//visibility:public"])', ""]
    for name in sorted(_LIBRARIES.keys()):
        modules, fallback = _LIBRARIES[name]
        defines, linkopts = _flags(ctx, modules)
        lines.append("cc_library(")
        lines.append("    name = %r," % name)
        lines.append("    defines = %r," % defines)
        lines.append("    linkopts = %r," % (linkopts + fallback))
        lines.append(")")
        lines.append("")
    ctx.file("WORKSPACE", 'workspace(name = "system_libs")\n')
    ctx.file("BUILD.bazel", "\n".join(lines))

system_libs = repository_rule(
    implementation = _system_libs_impl,
    environ = ["PKG_CONFIG_PATH"],
    local = True,
)

def system_library_repositories():
    system_libs(name = "system_libs")

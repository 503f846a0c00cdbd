"""cc_grpc_library: gRPC C++ stubs from a proto_library, with Debian's grpc_cpp_plugin."""

def _grpc_srcs_impl(ctx):
    info = ctx.attr.proto[ProtoInfo]
    outs = []
    for src in info.direct_sources:
        rel = src.path
        root = info.proto_source_root
        if root and root != "." and rel.startswith(root + "/"):
            rel = rel[len(root) + 1:]
        base = rel[:-len(".proto")]
        for ext in [".grpc.pb.h", ".grpc.pb.cc"]:
            outs.append(ctx.actions.declare_file(
                base.split("/")[-1] + ext,
                sibling = src,
            ))
    gen_dir = ctx.bin_dir.path
    if ctx.label.workspace_root:
        gen_dir += "/" + ctx.label.workspace_root
    args = ctx.actions.args()
    args.add("--plugin=protoc-gen-grpc=" + ctx.file._plugin.path)
    args.add("--grpc_out=" + gen_dir)
    for d in info.transitive_proto_path.to_list():
        args.add("-I" + d)
    args.add_all(info.direct_sources)
    ctx.actions.run(
        inputs = depset(direct = [ctx.file._plugin], transitive = [info.transitive_sources]),
        outputs = outs,
        executable = ctx.executable._protoc,
        arguments = [args],
        mnemonic = "GrpcCppPlugin",
        progress_message = "Generating gRPC stubs for %s" % ctx.label,
    )
    hdrs = [f for f in outs if f.path.endswith(".h")]
    srcs = [f for f in outs if f.path.endswith(".cc")]
    return [
        DefaultInfo(files = depset(outs)),
        OutputGroupInfo(hdrs = depset(hdrs), srcs = depset(srcs)),
    ]

_grpc_srcs = rule(
    implementation = _grpc_srcs_impl,
    attrs = {
        "proto": attr.label(providers = [ProtoInfo]),
        "_protoc": attr.label(
            default = "@com_google_protobuf//:protoc",
            executable = True,
            cfg = "host",
        ),
        "_plugin": attr.label(
            default = "@com_google_protobuf//:grpc_cpp_plugin",
            allow_single_file = True,
        ),
    },
)

def cc_grpc_library(name, proto, cc_proto, deps = [], **kwargs):
    """A cc_library with the gRPC stubs of `proto`, depending on its cc_proto_library."""
    _grpc_srcs(name = name + "_srcs", proto = proto)
    native.filegroup(name = name + "_hdrs", srcs = [":" + name + "_srcs"], output_group = "hdrs")
    native.filegroup(name = name + "_ccs", srcs = [":" + name + "_srcs"], output_group = "srcs")
    native.cc_library(
        name = name,
        srcs = [":" + name + "_ccs"],
        hdrs = [":" + name + "_hdrs"],
        deps = [cc_proto, "@system_libs//:grpc++"] + deps,
        **kwargs
    )

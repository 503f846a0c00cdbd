"""integration_test: a Catch2 test that starts real refitd processes (and may run refitctl)."""

def integration_test(name, srcs, env = {}, tags = [], deps = [], data = []):
    native.cc_test(
        name = name,
        size = "medium",
        srcs = srcs,
        data = [
            "//client:refitctl",
            "//daemon:refitd",
        ] + data,
        env = env,
        tags = tags,
        deps = [
            "//client:refit_client",
            "//tests/catch:catch_main",
            "//tests/testing",
            "@system_libs//:absl",
            "@system_libs//:catch2",
        ] + deps,
    )

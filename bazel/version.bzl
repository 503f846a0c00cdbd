"""version_source: the C++ file defining refit's version (kRefitVersion of daemon/version.h),
from the VERSION file and the workspace status (bazel/workspace_status.sh adds the mark of a
dirty git tree)."""

def _version_source_impl(ctx):
    out = ctx.actions.declare_file(ctx.attr.out)
    ctx.actions.run_shell(
        inputs = [ctx.file.version_file, ctx.info_file],
        outputs = [out],
        arguments = [ctx.file.version_file.path, ctx.info_file.path, out.path],
        command = """
set -eu
base=$(tr -d '[:space:]' < "$1")
case "$base" in
  "" | *[!0-9.]*) echo "VERSION holds '$base', not MAJOR.MINOR.PATCH" >&2; exit 1 ;;
esac
full=$(sed -n 's/^STABLE_REFIT_VERSION //p' "$2")
full=${full:-$base}
case "$full" in
  "$base" | "$base"~*) ;;
  *) echo "workspace status says version '$full', VERSION says '$base'" >&2; exit 1 ;;
esac
{
  echo '// Generated from VERSION by bazel/version.bzl (with "~dirty" for an unclean git tree).'
  echo '#include "daemon/version.h"'
  echo ''
  echo 'namespace refit {'
  echo "const char kRefitVersion[] = \\"$full\\";"
  echo '}  // namespace refit'
} > "$3"
""",
        mnemonic = "RefitVersion",
        progress_message = "Writing %s" % out.short_path,
    )
    return [DefaultInfo(files = depset([out]))]

version_source = rule(
    implementation = _version_source_impl,
    attrs = {
        "version_file": attr.label(allow_single_file = True, mandatory = True),
        "out": attr.string(mandatory = True),
    },
)

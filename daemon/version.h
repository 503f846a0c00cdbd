#pragma once

// refit's release version, shown by `refitd --version`, Status and refitctl.
namespace refit {
inline constexpr char kRefitVersion[] = "0.1.0";
}  // namespace refit

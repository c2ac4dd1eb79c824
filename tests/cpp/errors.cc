#include "errors.h"

namespace mctest {

testing::AssertionResult throws_error(mooncake::ErrorKind kind, const std::function<void()>& fn,
                                      const std::string& contains) {
  try {
    fn();
  } catch (const mooncake::Error& e) {
    if (e.kind() == kind && std::string(e.what()).find(contains) != std::string::npos)
      return testing::AssertionSuccess() << e.what();
    if (e.kind() == kind)
      return testing::AssertionFailure()
             << "expected the message to contain '" << contains << "', got: " << e.what();
    return testing::AssertionFailure()
           << "expected an error of kind '" << mooncake::error_kind_name(kind) << "', got '"
           << mooncake::error_kind_name(e.kind()) << "': " << e.what();
  } catch (const std::exception& e) {
    return testing::AssertionFailure()
           << "expected an error of kind '" << mooncake::error_kind_name(kind)
           << "', got another exception: " << e.what();
  }
  return testing::AssertionFailure()
         << "expected an error of kind '" << mooncake::error_kind_name(kind) << "', got none";
}

}  // namespace mctest

// Turns a request's outcome into a call that throws its error, for throws_error().
#pragma once

#include <functional>
#include <memory>
#include <stdexcept>

#include "collectives/request.h"

namespace mctest {

// A call that waits (bounded) for `req` and rethrows the error it completed with.
inline std::function<void()> rethrow_error_of(const std::shared_ptr<mooncake::Request>& req,
                                              int64_t wait_ms = 10000) {
  return [req, wait_ms] {
    if (!req->wait(wait_ms)) throw std::runtime_error("the request never completed");
    if (auto e = req->error()) std::rethrow_exception(e);
  };
}

}  // namespace mctest

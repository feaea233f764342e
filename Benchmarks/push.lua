-- wrk script for Benchmarks/push.sh. Arguments: TOKENS_FILE THREADS [PAUSE_MS [FIRST]].
-- POSTs a different compact SET on each request: tokens are read from TOKENS_FILE, and the
-- threads take interleaved ones, so none is sent twice until the file is used up. With PAUSE_MS,
-- each connection waits that long between its requests (a fixed rate of at most
-- connections * 1000 / PAUSE_MS requests a second). FIRST: the index of the first token to send
-- (a later run starts past the tokens an earlier one sent, so it sends no duplicates).
local count = 0
function setup(thread)
  thread:set("id", count)
  count = count + 1
end

function init(args)
  tokens = {}
  for line in io.lines(args[1]) do
    if #line > 0 then tokens[#tokens + 1] = line end
  end
  nthreads = tonumber(args[2])
  pause = tonumber(args[3] or "0")
  first = tonumber(args[4] or "0")
  n = 0
end

function request()
  local index = (first + n * nthreads + id) % #tokens + 1
  n = n + 1
  return wrk.format("POST", nil, { ["Content-Type"] = "application/secevent+jwt", ["Accept"] = "application/json" }, tokens[index])
end

function delay()
  return pause
end

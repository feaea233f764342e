import Foundation
@testable import Redis
import Testing
import WardenTestSupport

@Suite("Redis client over hiredis, against a real redis-server")
struct RedisClientTests {
    @Test func commandsAndPipelinedReplies() async throws {
        let server = try await RedisServer()
        let client = RedisClient(settings: .init(host: "127.0.0.1", port: server.port))
        defer { client.close() }
        #expect(try await client.send(["SET", "k", "v"]) == .status("OK"))
        let replies = try await client.pipeline([["GET", "k"], ["SADD", "s", "a", "b"], ["SMEMBERS", "s"], ["GET", "missing"],
                                                 ["INCR", "k"]])
        #expect(replies[0] == .string(Array("v".utf8)))
        #expect(replies[1] == .integer(2))
        #expect(Set(replies[2].array?.compactMap(\.text) ?? []) == ["a", "b"])
        #expect(replies[3] == .null)
        guard case .error(let message) = replies[4] else { Issue.record("INCR on a string must fail"); return }
        #expect(message.contains("not an integer"))
        // Another client sees what this one wrote.
        #expect(try await server.cli(["SCARD", "s"]) == "2")
    }

    // Concurrent callers' requests share round trips, and each caller gets its own replies, in
    // its own order.
    @Test func concurrentRequestsShareRoundTripsAndKeepTheirReplies() async throws {
        let server = try await RedisServer()
        let client = RedisClient(settings: .init(host: "127.0.0.1", port: server.port, poolSize: 1))
        defer { client.close() }
        let callers = 400
        try await withThrowingTaskGroup(of: Void.self) { group in
            for i in 0..<callers {
                group.addTask {
                    let replies = try await client.pipeline([["SET", "k\(i)", "v\(i)"], ["GET", "k\(i)"], ["INCRBY", "n", "\(i)"]])
                    #expect(replies.count == 3)
                    #expect(replies[0] == .status("OK"))
                    #expect(replies[1] == .string(Array("v\(i)".utf8)))
                }
            }
            try await group.waitForAll()
        }
        #expect(try await server.cli(["GET", "n"]) == "\(callers * (callers - 1) / 2)")
        #expect(client.roundTrips.load(ordering: .relaxed) < callers)
    }

    // A connection that fails under a shared round trip fails every request it carried, with a
    // retryable error; the next request reconnects.
    @Test func aFailedSharedRoundTripFailsEachOfItsRequestsRetryably() async throws {
        let server = try await RedisServer()
        let client = RedisClient(settings: .init(host: "127.0.0.1", port: server.port, poolSize: 1))
        defer { client.close() }
        _ = try await client.send(["PING"])
        _ = try await server.cli(["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"])
        let results = await withTaskGroup(of: Bool?.self) { group in
            for _ in 0..<20 {
                group.addTask {
                    do throws(RedisError) { _ = try await client.send(["PING"]); return nil } catch { return error.isRetryable }
                }
            }
            return await group.reduce(into: [Bool?]()) { $0.append($1) }
        }
        // Those that failed did so retryably; at least the first round trip failed.
        #expect(results.contains { $0 == true })
        #expect(!results.contains { $0 == false })
        #expect(try await client.send(["PING"]) == .status("PONG"))
    }

    @Test func binaryValuesRoundTrip() async throws {
        let server = try await RedisServer()
        let client = RedisClient(settings: .init(host: "127.0.0.1", port: server.port))
        defer { client.close() }
        let value: [UInt8] = [0, 1, 2, 0xFF, 0x0D, 0x0A, 0]
        _ = try await client.pipeline([[Array("SET".utf8), Array("bin".utf8), value]])
        #expect(try await client.send(["GET", "bin"]) == .string(value))
    }

    /// The protocol's encoding, written by the client itself: counts in decimal, lengths in
    /// bytes (not characters), empty arguments, and bytes that look like line ends.
    @Test func commandsAreEncodedAsTheProtocolSays() async throws {
        var encoded = RESPEncoding()
        encoded.append(["SET", "", "é"].lazy.map(\.utf8))
        #expect(String(decoding: encoded.bytes, as: UTF8.self) == "*3\r\n$3\r\nSET\r\n$0\r\n\r\n$2\r\né\r\n")
        var long = RESPEncoding()
        long.append([[UInt8]](repeating: [0x0D, 0x0A], count: 10) + [[UInt8](repeating: 0x61, count: 1234)])
        #expect(String(decoding: long.bytes.prefix(13), as: UTF8.self) == "*11\r\n$2\r\n\r\n\r\n")
        #expect(String(decoding: long.bytes.suffix(7 + 1234 + 2).prefix(10), as: UTF8.self) == "$1234\r\naaa")
        let expectedCount = 5 + 10 * 8 + 7 + 1234 + 2
        #expect(long.bytes.count == expectedCount)
        // And a server reads them back whole.
        let server = try await RedisServer()
        let client = RedisClient(settings: .init(host: "127.0.0.1", port: server.port))
        defer { client.close() }
        let values = ["", "é\r\n*1\r\n", String(repeating: "x", count: 100_000)]
        _ = try await client.pipeline(values.enumerated().map { ["SET", "k\($0.offset)", $0.element] })
        for (i, value) in values.enumerated() { #expect(try await client.send(["GET", "k\(i)"]) == .string(Array(value.utf8))) }
    }

    @Test func passwordAndDatabaseNumber() async throws {
        let server = try await RedisServer(password: "correct horse")
        let client = RedisClient(settings: .init(host: "127.0.0.1", port: server.port, database: 3, password: "correct horse"))
        defer { client.close() }
        _ = try await client.send(["SET", "in-three", "1"])
        #expect(try await server.cli(["-n", "3", "EXISTS", "in-three"]) == "1")
        #expect(try await server.cli(["-n", "0", "EXISTS", "in-three"]) == "0")

        let wrong = RedisClient(settings: .init(host: "127.0.0.1", port: server.port, password: "wrong horse"))
        defer { wrong.close() }
        do {
            _ = try await wrong.send(["PING"])
            Issue.record("a wrong password must fail")
        } catch {
            #expect(!error.isRetryable)
            #expect(error.message.contains("refused AUTH"))
            #expect(!error.message.contains("wrong horse"))
        }
    }

    @Test func reconnectsAfterTheServerRestarts() async throws {
        let server = try await RedisServer()
        let client = RedisClient(settings: .init(host: "127.0.0.1", port: server.port, poolSize: 2, timeout: 2))
        defer { client.close() }
        #expect(try await client.send(["PING"]) == .status("PONG"))
        await server.stop()
        do {
            _ = try await client.send(["PING"])
            Issue.record("a stopped server must not answer")
        } catch {
            #expect(error.isRetryable)
        }
        try await server.start()
        // The broken connection was dropped; the next call opens a new one.
        var answered = false
        for _ in 0..<3 where !answered {
            answered = (try? await client.send(["PING"])) == .status("PONG")
        }
        #expect(answered)
    }

    @Test func manyConcurrentCallersShareThePool() async throws {
        let server = try await RedisServer()
        let client = RedisClient(settings: .init(host: "127.0.0.1", port: server.port, poolSize: 3))
        defer { client.close() }
        try await withThrowingTaskGroup(of: Void.self) { group in
            for i in 0..<200 {
                group.addTask { _ = try await client.pipeline([["SADD", "all", "m\(i)"], ["INCR", "count"]]) }
            }
            try await group.waitForAll()
        }
        #expect(try await client.send(["SCARD", "all"]) == .integer(200))
        #expect(try await client.send(["GET", "count"]).text == "200")
        #expect(Int(try await server.cli(["CLIENT", "LIST"]).split(separator: "\n").count) <= 4)  // 3 pooled + redis-cli
    }
}

import Foundation
import NIOCore
@testable import Redis
import Testing
import WardenTestSupport

@Suite("Redis client against a real redis-server")
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

    // A connection that fails under a round trip fails every request it carried, with a
    // retryable error; the next request reconnects.
    @Test func aFailedSharedRoundTripFailsEachOfItsRequestsRetryably() async throws {
        let server = try await RedisServer()
        let client = RedisClient(settings: .init(host: "127.0.0.1", port: server.port, poolSize: 1))
        defer { client.close() }
        _ = try await client.send(["PING"])
        // A round trip the server holds (BLPOP waits), and the connection killed under it.
        async let blocked = { () async -> RedisError? in
            do throws(RedisError) { _ = try await client.pipeline([["BLPOP", "nothing", "10"], ["PING"]]); return nil } catch { return error }
        }()
        for _ in 0..<200 {
            if try await server.cli(["CLIENT", "LIST"]).contains("cmd=blpop") { break }
            try await Task.sleep(for: .milliseconds(10))
        }
        _ = try await server.cli(["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"])
        let failure = await blocked
        #expect(failure?.isRetryable == true)
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
        try await Self.expectReconnect(client, afterRestartOf: server)
    }

    /// A stopped server fails the call retryably; once it is back, the broken connection has
    /// been dropped and a new one answers.
    static func expectReconnect(_ client: RedisClient, afterRestartOf server: RedisServer) async throws {
        #expect(try await client.send(["PING"]) == .status("PONG"))
        await server.stop()
        do {
            _ = try await client.send(["PING"])
            Issue.record("a stopped server must not answer")
        } catch {
            #expect(error.isRetryable)
        }
        try await server.start()
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

    // A round trip that lasts longer than the timeout, but whose replies keep coming well
    // within it, is not cut: the deadline restarts with each read that brings replies.
    @Test func aLongRoundTripWhoseRepliesKeepComingIsNotCut() async throws {
        let server = try await RedisServer()
        let client = RedisClient(settings: .init(host: "127.0.0.1", port: server.port, poolSize: 1, timeout: 1))
        defer { client.close() }
        // Each BLPOP waits 0.4 s for a list nobody fills, then answers nil: five replies 0.4 s
        // apart, 2 s in all.
        let replies = try await client.pipeline(Array(repeating: ["BLPOP", "nobody-fills-this", "0.4"], count: 5))
        #expect(replies == Array(repeating: .null, count: 5))
    }
}

@Suite("Redis over TLS, against redis-server with --tls-port")
struct RedisTLSTests {
    static func server(clientCertificates: Bool = false, names: [String] = ["DNS:localhost", "IP:127.0.0.1"])
        async throws -> (RedisServer, TestCertificates)
    {
        let certificates = try await TestCertificates.shared()
        let pair = try await certificates.issue("redis-\(names.count)-\(UUID().uuidString.prefix(6))", subjectAlternativeNames: names)
        let client = clientCertificates ? try await certificates.issue("client", subjectAlternativeNames: [], client: true) : nil
        let server = try await RedisServer(password: "tls horse",
                                           tls: .init(server: pair, caFile: certificates.caFile, clientCertificate: client))
        return (server, certificates)
    }

    @Test func commandsPipeliningAuthAndDatabaseOverTLS() async throws {
        let (server, certificates) = try await Self.server()
        for host in ["localhost", "127.0.0.1"] {
            let client = RedisClient(settings: .init(host: host, port: server.port, database: 2, password: "tls horse",
                                                     tls: .init(caFile: certificates.caFile), poolSize: 2))
            defer { client.close() }
            try await withThrowingTaskGroup(of: Void.self) { group in
                for i in 0..<100 {
                    group.addTask {
                        let replies = try await client.pipeline([["SET", "\(host)-\(i)", "v\(i)"], ["GET", "\(host)-\(i)"]])
                        #expect(replies == [.status("OK"), .string(Array("v\(i)".utf8))])
                    }
                }
                try await group.waitForAll()
            }
            #expect(client.roundTrips.load(ordering: .relaxed) < 100)
            // An independent client over TLS sees the keys in database 2, not in 0.
            #expect(try await server.cli(["-n", "2", "EXISTS", "\(host)-7"]) == "1")
            #expect(try await server.cli(["-n", "0", "EXISTS", "\(host)-7"]) == "0")
        }
    }

    @Test func aServerSignedByAnotherAuthorityIsRefusedClearlyAndNotRetried() async throws {
        let (server, certificates) = try await Self.server()
        let client = RedisClient(settings: .init(host: "localhost", port: server.port, password: "tls horse",
                                                 tls: .init(caFile: certificates.otherCAFile)))
        defer { client.close() }
        do {
            _ = try await client.send(["PING"])
            Issue.record("a server whose CA is not trusted must be refused")
        } catch {
            #expect(!error.isRetryable)
            #expect(error.message.contains("not signed by a trusted authority"), "\(error.message)")
            #expect(error.message.contains("localhost:\(server.port)"))
            #expect(!error.message.contains("tls horse"))
        }
    }

    @Test func aCertificateForAnotherNameIsRefused() async throws {
        let (server, certificates) = try await Self.server(names: ["DNS:cache.internal"])
        let client = RedisClient(settings: .init(host: "localhost", port: server.port, password: "tls horse",
                                                 tls: .init(caFile: certificates.caFile)))
        defer { client.close() }
        do {
            _ = try await client.send(["PING"])
            Issue.record("a certificate for cache.internal must not be accepted for localhost")
        } catch {
            #expect(!error.isRetryable)
            #expect(error.message.contains("not for that name"), "\(error.message)")
        }
        // And by IP address: 127.0.0.1 is not among its names either.
        let byAddress = RedisClient(settings: .init(host: "127.0.0.1", port: server.port, password: "tls horse",
                                                    tls: .init(caFile: certificates.caFile)))
        defer { byAddress.close() }
        await #expect(throws: RedisError.self) { _ = try await byAddress.send(["PING"]) }
    }

    @Test func aClientCertificateWhenTheServerAsksForOne() async throws {
        let (server, certificates) = try await Self.server(clientCertificates: true)
        let pair = server.tls!.clientCertificate!
        let with = RedisClient(settings: .init(host: "localhost", port: server.port, password: "tls horse",
                                               tls: .init(caFile: certificates.caFile, certificateFile: pair.certificateFile,
                                                          keyFile: pair.keyFile)))
        defer { with.close() }
        #expect(try await with.send(["PING"]) == .status("PONG"))
        let without = RedisClient(settings: .init(host: "localhost", port: server.port, password: "tls horse",
                                                  tls: .init(caFile: certificates.caFile)))
        defer { without.close() }
        await #expect(throws: RedisError.self) { _ = try await without.send(["PING"]) }
    }

    // A server that keeps the connection and answers nothing: the call fails within the
    // timeout (not the timeout plus TLS's close), retryably; a thawed server answers again.
    @Test func aWedgedServerTimesOutAndTheNextCallReconnects() async throws {
        let (server, certificates) = try await Self.server()
        let client = RedisClient(settings: .init(host: "localhost", port: server.port, password: "tls horse",
                                                 tls: .init(caFile: certificates.caFile), poolSize: 1, timeout: 0.5))
        defer { client.close() }
        #expect(try await client.send(["PING"]) == .status("PONG"))
        server.freeze()
        do {
            _ = try await client.send(["PING"])
            Issue.record("a frozen server must not answer")
        } catch {
            #expect(error.isRetryable)
            #expect(error.message.contains("no reply within 0.5 s"), "\(error.message)")
        }
        server.thaw()
        #expect(try await client.send(["PING"]) == .status("PONG"))
        await #expect(throws: RedisError.self) { _ = try await client.pipeline([[String]]([[]])) }
    }

    @Test func aMissingCAFileIsNamed() async throws {
        let client = RedisClient(settings: .init(host: "localhost", port: 1, tls: .init(caFile: "/nonexistent/ca.pem")))
        defer { client.close() }
        do {
            _ = try await client.send(["PING"])
            Issue.record("a missing CA file must fail")
        } catch {
            #expect(!error.isRetryable)
            #expect(error.message.contains("/nonexistent/ca.pem"))
        }
    }

    @Test func reconnectsOverTLSAfterARestart() async throws {
        let (server, certificates) = try await Self.server()
        let client = RedisClient(settings: .init(host: "localhost", port: server.port, password: "tls horse",
                                                 tls: .init(caFile: certificates.caFile), poolSize: 1, timeout: 2))
        defer { client.close() }
        try await RedisClientTests.expectReconnect(client, afterRestartOf: server)
    }
}

@Suite("Reading replies")
struct RESPDecoderTests {
    @Test func whichErrorRepliesPass() {
        for passing in ["LOADING Redis is loading", "BUSY script running", "READONLY You can't write against a read only replica.",
                        "NOREPLICAS Not enough good replicas", "MISCONF snapshots", "TRYAGAIN", "MASTERDOWN", "CLUSTERDOWN"] {
            #expect(RedisReply.error(passing).isTransientError, "\(passing)")
        }
        for lasting in ["BUSYKEY Target key name already exists.", "BUSYGROUP Consumer Group name already exists",
                        "WRONGTYPE Operation against a key", "NOPERM", "ERR unknown command"] {
            #expect(!RedisReply.error(lasting).isTransientError, "\(lasting)")
        }
        #expect(!RedisReply.status("LOADING").isTransientError)
    }

    @Test func wholeAndPartialRepliesAndMalformedOnes() throws {
        var buffer = ByteBuffer(string: "*3\r\n$1\r\na\r\n:-7\r\n*2\r\n+OK\r\n$-1\r\n-ERR no\r\n")
        #expect(try RESPDecoder.parse(&buffer, depth: 0) == .array([.string([0x61]), .integer(-7), .array([.status("OK"), .null])]))
        #expect(try RESPDecoder.parse(&buffer, depth: 0) == .error("ERR no"))
        #expect(buffer.readableBytes == 0)
        // Every cut of a reply waits for more.
        let whole = Array("*2\r\n$5\r\nhe\r\nl\r\n:12\r\n".utf8)
        for cut in 0..<whole.count {
            var part = ByteBuffer(bytes: whole.prefix(cut))
            #expect(try RESPDecoder.parse(&part, depth: 0) == nil)
        }
        var all = ByteBuffer(bytes: whole)
        #expect(try RESPDecoder.parse(&all, depth: 0) == .array([.string(Array("he\r\nl".utf8)), .integer(12)]))
        for bad in ["?x\r\n", ":12a\r\n", "$3\r\nabcde\r\n", "*-2\r\n", "+a\rb\r\n", String(repeating: "*1\r\n", count: 40) + ":1\r\n"] {
            var buffer = ByteBuffer(string: bad)
            #expect(throws: RESPDecoder.MalformedReply.self) { _ = try RESPDecoder.parse(&buffer, depth: 0) }
        }
        // Lengths that would overflow or exhaust memory are refused, not trusted.
        for bad in ["$9223372036854775807\r\n", "$9223372036854775806\r\n", "$\(RESPDecoder.maximumBulk + 1)\r\n",
                    "*9223372036854775807\r\n"] {
            var buffer = ByteBuffer(string: bad)
            #expect(throws: RESPDecoder.MalformedReply.self) { _ = try RESPDecoder.parse(&buffer, depth: 0) }
        }
        var long = ByteBuffer(string: "+" + String(repeating: "x", count: RESPDecoder.maximumLine + 10))
        #expect(throws: RESPDecoder.MalformedReply.self) { _ = try RESPDecoder.parse(&long, depth: 0) }
    }
}

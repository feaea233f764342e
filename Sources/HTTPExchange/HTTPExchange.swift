import Foundation
public import AsyncHTTPClient
public import NIOCore
public import NIOHTTP1

/// One HTTP request and its whole answer, head and body, read under one deadline.
///
/// async-http-client's deadline covers a request until its head arrives; a server that sends
/// its head and then stalls would hold the body's reader for ever — a key refresh (and every
/// verification waiting on it), a step, a breaker's trial call, shutdown. Here the deadline
/// covers everything: when it passes, the request is cancelled and its connection closed.
public struct HTTPExchange: Sendable {
    public var status: HTTPResponseStatus
    public var headers: HTTPHeaders
    public var body: ByteBuffer
}

/// Why an exchange did not complete.
public struct HTTPExchangeError: Error, Sendable, CustomStringConvertible {
    public enum Kind: Sendable, Hashable {
        /// Nothing complete within the deadline (connecting, the head or the body).
        case deadline
        /// The body is larger than the caller accepts.
        case tooLarge
        /// The connection failed or the server broke the exchange.
        case transport
    }

    public var kind: Kind
    public var description: String
    /// An answer whose body was too large: its status and headers, without the body. A caller
    /// that needs only the status (a revocation, a webhook) goes on with it.
    public var head: HTTPExchange? = nil

    /// A slow or unreachable server may answer later; an oversized body will be oversized
    /// again. (Callers that need only the status judge `head` themselves.)
    public var isRetryable: Bool { kind != .tooLarge }
}

extension HTTPClient {
    /// Sends `request` and reads its whole answer, all within `timeout` seconds; a body over
    /// `maximumBodyBytes` is refused.
    public func exchange(_ request: HTTPClientRequest, timeout: Double, maximumBodyBytes: Int) async throws(HTTPExchangeError)
        -> HTTPExchange
    {
        // Bounded (a timeout of years is a mistake) so that nanoseconds fit in an Int64.
        let seconds = min(max(timeout, 0.001), 1e9)
        let outcome: Result<HTTPExchange, HTTPExchangeError> = await withTaskGroup(of: Result<HTTPExchange, HTTPExchangeError>?.self) {
            group in
            group.addTask {
                let response: HTTPClientResponse
                do {
                    response = try await self.execute(request, timeout: .nanoseconds(Int64(seconds * 1e9)))
                } catch {
                    return .failure(HTTPExchangeError(kind: .transport, description: "\(error)"))
                }
                do {
                    let body = try await response.body.collect(upTo: maximumBodyBytes)
                    return .success(HTTPExchange(status: response.status, headers: response.headers, body: body))
                } catch let error as NIOTooManyBytesError {
                    return .failure(HTTPExchangeError(kind: .tooLarge, description: "the body is over \(maximumBodyBytes) bytes (\(error))",
                                                      head: HTTPExchange(status: response.status, headers: response.headers, body: ByteBuffer())))
                } catch {
                    return .failure(HTTPExchangeError(kind: .transport, description: "the body could not be read: \(error)"))
                }
            }
            group.addTask {
                // nil: the deadline passed (a cancelled sleep ends the same way, and is ignored).
                try? await _Concurrency.Task.sleep(for: .nanoseconds(Int64(seconds * 1e9)))
                return nil
            }
            defer { group.cancelAll() }
            let first = await group.next() ?? nil
            return first ?? .failure(HTTPExchangeError(kind: .deadline, description: "no complete answer within \(wholeOrFraction(seconds)) s"))
        }
        return try outcome.get()
    }
}

private func wholeOrFraction(_ seconds: Double) -> String {
    seconds.rounded() == seconds && seconds < 1e9 ? String(Int(seconds)) : String(seconds)
}

/// The small pieces of HTTP every outgoing call shares.
public enum HTTPRules {
    /// Whether `host` is this machine: `localhost`, or an IPv4 (127.0.0.0/8) or IPv6 (`::1`)
    /// loopback address, with or without brackets. Plain http is allowed only to these, and no
    /// proxy is used for them.
    public static func isLoopback(_ host: String?) -> Bool {
        guard var host = host?.lowercased() else { return false }
        if host.hasPrefix("["), host.hasSuffix("]") { host = String(host.dropFirst().dropLast()) }
        if host == "localhost" { return true }
        guard let address = NoProxy.ipAddress(host) else { return false }
        return address.count == 4 ? address[0] == 127 : address == [UInt8](repeating: 0, count: 15) + [1]
    }

    /// `application/x-www-form-urlencoded` encoding of one name or value (also the form a client
    /// id and secret take inside HTTP Basic credentials, RFC 6749 §2.3.1).
    public static func formEncoded(_ text: String) -> String {
        var allowed = CharacterSet.alphanumerics
        allowed.insert(charactersIn: "-._*")
        return (text.addingPercentEncoding(withAllowedCharacters: allowed) ?? text).replacingOccurrences(of: "%20", with: "+")
    }

    /// `Retry-After`: delay seconds or an HTTP date, as seconds from now.
    public static func retryAfter(_ value: String) -> Double? {
        if let seconds = Double(value.trimmingCharacters(in: .whitespaces)), seconds >= 0 { return seconds }
        let formatter = DateFormatter()
        formatter.locale = Locale(identifier: "en_US_POSIX")
        formatter.timeZone = TimeZone(identifier: "GMT")
        formatter.dateFormat = "EEE, dd MMM yyyy HH:mm:ss zzz"
        guard let date = formatter.date(from: value) else { return nil }
        return max(0, date.timeIntervalSinceNow)
    }
}

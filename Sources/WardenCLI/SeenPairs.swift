import Foundation
import GRDB

/// The (issuer, jti) pairs a replay has met, as 64-bit hashes: in memory up to `memoryLimit`
/// (about 16 bytes each), then moved to a temporary SQLite file and the memory set started
/// again — so a replay's memory stays bounded however long its log. The hash is Swift's
/// `Hasher`, seeded anew by each process: no log can be made to collide on purpose, and by
/// chance two of a billion pairs collide with odds of about one in 36.
final class SeenPairs {
    let memoryLimit: Int
    private var memory = Set<Int>()
    private var spill: (queue: DatabaseQueue, path: String)?

    init(memoryLimit: Int = 1 << 20) {
        self.memoryLimit = memoryLimit
    }

    deinit {
        if let spill { try? FileManager.default.removeItem(atPath: spill.path) }
    }

    static func hash(_ value: some Hashable) -> Int {
        var hasher = Hasher()
        hasher.combine(value)
        return hasher.finalize()
    }

    /// Whether `hash` was met before (without recording it).
    func contains(_ hash: Int) throws -> Bool {
        if memory.contains(hash) { return true }
        guard let spill else { return false }
        return try spill.queue.read { db in try Bool.fetchOne(db, sql: "SELECT 1 FROM seen WHERE h = ?", arguments: [hash]) } ?? false
    }

    /// Records each hash, in order; for each, whether it is new (not met before, in this call
    /// or any earlier one).
    func insert(_ hashes: [Int]) throws -> [Bool] {
        var spilled = Set<Int>()
        if let spill {
            let candidates = Array(Set(hashes.filter { !memory.contains($0) }))
            if !candidates.isEmpty {
                try spill.queue.read { db in
                    for chunk in stride(from: 0, to: candidates.count, by: 500) {
                        let part = Array(candidates[chunk..<min(chunk + 500, candidates.count)])
                        let found = try Int.fetchAll(db, sql: "SELECT h FROM seen WHERE h IN (\(databaseQuestionMarks(count: part.count)))",
                                                     arguments: StatementArguments(part))
                        spilled.formUnion(found)
                    }
                }
            }
        }
        var new: [Bool] = []
        new.reserveCapacity(hashes.count)
        for hash in hashes {
            new.append(!spilled.contains(hash) && memory.insert(hash).inserted)
        }
        if memory.count >= memoryLimit { try moveToDisk() }
        return new
    }

    private func moveToDisk() throws {
        if spill == nil {
            let path = NSTemporaryDirectory() + "warden-replay-seen-\(UUID().uuidString).sqlite"
            var configuration = Configuration()
            configuration.journalMode = .default
            let queue = try DatabaseQueue(path: path, configuration: configuration)
            try queue.writeWithoutTransaction { db in
                try db.execute(sql: "PRAGMA synchronous = OFF")
                try db.execute(sql: "CREATE TABLE seen (h INTEGER PRIMARY KEY) WITHOUT ROWID")
            }
            spill = (queue, path)
        }
        let hashes = memory
        try spill!.queue.inTransaction { db in
            let insert = try db.makeStatement(sql: "INSERT OR IGNORE INTO seen (h) VALUES (?)")
            for hash in hashes { try insert.execute(arguments: [hash]) }
            return .commit
        }
        memory = Set(minimumCapacity: memoryLimit / 4)
    }
}

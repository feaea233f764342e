import WardenCLI

await WardenCommand.runMain()
